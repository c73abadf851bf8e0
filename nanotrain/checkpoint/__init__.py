"""Saved training state: one process's checkpoint (``state.py``: a Hugging Face folder and
``optimizer.safetensors``), the sharded format any layout resumes (``slices.py``, ``sharded.py``), the run
folder's checkpoints published atomically and found again (``run_dir.py``), their checksums
(``checksums.py``) and the free space a save needs (``disk.py``). docs/CHECKPOINTS.md says what a folder holds."""
