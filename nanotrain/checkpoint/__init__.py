"""Saved training state in one format, whatever the layout: every trainer's shard (``core.train.shard``) written
by one writer (``state.py``, on a thread while training goes on: ``background.py``) and read back at any layout
by one reader (``resume.py``) through the format (``slices.py``: a manifest of leaf slices; ``legacy.py`` reads
the old one-process layout as one); the run folder's checkpoints published atomically and found again
(``run_dir.py``), their checksums (``checksums.py``) and the free space a save needs (``disk.py``); a checkpoint
as a folder that serves (``export.py``). docs/CHECKPOINTS.md says what a folder and an export hold."""
