"""Data parallelism by hand: DDP and ZeRO-1/2/3 on the trainers' unit-ready seam.

Every rank of the data-parallel group holds the model (or, under ZeRO-3, its shard of it) and
runs the same steps on its slice of each global batch (``trainer.py``), with the loss divided by
the whole batch's target count so that summed gradients are exactly the one-process gradient.

- ``optimizer.py``: DDP, ZeRO-1 and ZeRO-2 through the optimizer the ``ResidentTrainer`` (or the 3D engine,
  ``parallel3d.trainer``) is built with: each bucket of gradients (``buckets.py``) is reduced as soon as it is
  final, overlapping the rest of backward.
- ``zero3.py``: ZeRO-3, weights sharded too, each unit gathered just before use and freed after.
- ``streamed.py``: weight streaming under data parallelism (ZeRO-Offload), each rank's shard of masters and
  moments in host memory; ``deferred.py``: its step with clipping or fp16.
- ``shards.py``: a rank's pieces of the masters and moments, and the single-process format they go to and from.
- ``slices.py`` and ``checkpoint.py``: the one sharded checkpoint format, which any layout resumes (another world
  size, ZeRO stage, and for 3D another dp, tp or pp), and which consolidates to one Hugging Face folder.
- ``launch.py``: the task side (options, torchrun or local processes, elastic restarts).
- ``comms.py``: the collectives, as small named functions taking their group.

Placement in the layers: above ``optim/`` and ``train/`` (it wraps ``OffloadAdam``, ``StreamedAdam``,
``ResidentTrainer`` and ``StreamTrainer``) and below ``tasks/``; nothing below imports it.
"""
from nanotrain.data_parallel.buckets import Bucket, plan_buckets
from nanotrain.data_parallel.config import DPConfig
from nanotrain.data_parallel.optimizer import DataParallelAdam
from nanotrain.data_parallel.trainer import DataParallelTrainer, check_split, data_parallel_trainer

__all__ = ["Bucket", "DPConfig", "DataParallelAdam", "DataParallelTrainer", "check_split", "data_parallel_trainer",
           "plan_buckets"]
