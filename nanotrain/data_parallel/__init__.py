"""Data parallelism by hand: DDP and ZeRO-1/2 on the trainers' unit-ready seam.

Every rank of the data-parallel group holds the model and runs the same steps on its slice of
each global batch (``trainer.py``). The engine is applied from outside the model and the trainer,
through the optimizer the ``ResidentTrainer`` is built with (``optimizer.py``): the trainer
accumulates gradients in views of flat per-bucket buffers (``buckets.py``), hands each unit over
when its gradient is final, and the bucket's sum over ranks starts then, overlapping the rest of
backward; with ZeRO the optimizer state is sharded, and updated shards are all-gathered just
before the next forward uses them. Checkpoints keep the single-process format (``shards.py``), so
a run resumes at any world size. The collectives are small named functions in ``comms.py``.

Placement in the layers: above ``optim/`` and ``train/`` (it wraps ``OffloadAdam`` and
``ResidentTrainer``) and below ``tasks/``; nothing below imports it.
"""
from nanotrain.data_parallel.buckets import Bucket, plan_buckets
from nanotrain.data_parallel.optimizer import DataParallelAdam, DPConfig
from nanotrain.data_parallel.trainer import DataParallelTrainer, check_split, data_parallel_trainer

__all__ = ["Bucket", "DPConfig", "DataParallelAdam", "DataParallelTrainer", "check_split", "data_parallel_trainer",
           "plan_buckets"]
