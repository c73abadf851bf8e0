"""The single-GPU memory work: activation recompute, the memory planner, host buffers, the boundary store."""
