"""Data parallelism by hand: DDP and ZeRO-1/2/3 on the trainers' unit-ready seam.

Every rank of the data-parallel group holds the model (or, under ZeRO-3, its shard of it) and
runs the same steps on its slice of each global batch (``trainer.py``), with the loss divided by
the whole batch's target count so that summed gradients are exactly the one-process gradient.

- ``optimizer.py``: DDP, ZeRO-1 and ZeRO-2 through the optimizer the ``ResidentTrainer`` (or the 3D engine,
  ``compose.trainer``) is built with: each bucket of gradients (``buckets.py``) is reduced as soon as it is
  final, overlapping the rest of backward.
- ``zero3.py``: ZeRO-3, weights sharded too, each unit gathered just before use and freed after.
- ``footprint.py``: each GPU's memory under DDP and ZeRO-1/2/3.
- ``shards.py``: a rank's pieces of the masters and moments, and the single-process format they go to and from.
- ``launch.py``: the task side (options, torchrun or local processes, elastic restarts).
- ``comms.py``: the collectives, as small named functions taking their group.

Weight streaming under data parallelism (ZeRO-Offload) lives with the streamed engine (``stream/sharded.py``,
built by ``stream/zero_offload.py``), on this room's buckets and collectives; the checkpoint format in
``checkpoint/``. This package does not import its trainer (``trainer.py``, which wraps a resident or streamed
one): a run imports it where it chooses data parallelism, and a one-process run loads none of it.
"""
from nanotrain.data_parallel.buckets import Bucket, plan_buckets
from nanotrain.data_parallel.config import DPConfig
from nanotrain.data_parallel.optimizer import DataParallelAdam

__all__ = ["Bucket", "DPConfig", "DataParallelAdam", "plan_buckets"]
