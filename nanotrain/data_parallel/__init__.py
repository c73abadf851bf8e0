"""Data parallelism by hand: DDP and ZeRO-1/2/3 on the trainers' unit-ready seam.

Every rank of the data-parallel group holds the model (or, under ZeRO-3, its shard of it) and
runs the same steps on its slice of each global batch (``trainer.py``), with the loss divided by
the whole batch's target count so that summed gradients are exactly the one-process gradient.

- ``optimizer.py``: DDP, ZeRO-1 and ZeRO-2 applied from outside the model and the trainer, through
  the optimizer the ``ResidentTrainer`` (or the 3D engine, ``parallel3d.trainer``) is built with. The
  trainer accumulates gradients in views of flat per-bucket buffers (``buckets.py``) and hands each
  unit over when its gradient is final; a bucket's sum (or reduce-scatter) starts then, overlapping
  the rest of backward. With ZeRO the optimizer state is sharded and updated shards are all-gathered
  just before the next forward uses them.
- ``zero3.py``: ZeRO-3, weights sharded too: the resident trainer's ``GatheredWeights``, each unit
  gathered just before use (the next one prefetched), freed after, and gathered again for the
  recomputed backward.
- ``streamed.py``: weight streaming under data parallelism (ZeRO-Offload): the streamed trainer's
  optimizer keeps each rank's shard of masters and moments in host memory, reduce-scatters each
  unit's gradient at its update and all-gathers the updated weights; ``deferred.py``: its step with
  clipping or fp16, the reduced shards kept in host memory until the step's norm or overflow is known.
- ``shards.py``: a rank's pieces of the masters and moments (one ``OffloadAdam`` for DDP, ZeRO-1/2/3),
  and the single-process format they are gathered into or cut from.
- ``slices.py`` and ``checkpoint.py``: the one sharded checkpoint format, a manifest of leaf slices that
  every rank writes its pieces into; any layout resumes it (another world size, ZeRO stage, and for 3D
  another dp, tp or pp), and it consolidates to one Hugging Face folder.
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
