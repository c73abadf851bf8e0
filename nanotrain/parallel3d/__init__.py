"""3D parallelism: a model tensor-parallel inside pipeline stages, the pipeline replicated data-parallel.

* ``layered``: this rank's tensor-parallel model as a ``LayeredModel`` (what the pipeline cuts into stages).
* ``grad_sync``: the three gradient reductions, the data-parallel one overlapped with the cool-down.
* ``step``: build this rank's share on the grid, one step.
* ``trainer``: the ``Trainer`` protocol over it, for the one loop.
* ``checkpoint``: per-shard saved state, resume at the same layout, export to one HF file.
* ``planner``: feasible layouts with predicted step time and memory per GPU, and the pick.
"""
from nanotrain.parallel3d.layered import tp_layered
from nanotrain.parallel3d.grad_sync import GradSync
from nanotrain.parallel3d.step import Parallel3D, build_3d, grads_3d, replica_slice, train_step_3d, update_3d
from nanotrain.parallel3d.trainer import Parallel3DTrainer

__all__ = ["GradSync", "Parallel3D", "Parallel3DTrainer", "build_3d", "grads_3d", "replica_slice", "tp_layered",
           "train_step_3d", "update_3d"]
