"""ZeRO-Offload's trainer: the streamed trainer on each rank's rows of the global batch, its masters and moments
sharded over the data-parallel group (``sharded.py``), wrapped by the data-parallel engine's ``DataParallelTrainer``
(which splits the batch and reports the step), as ``data_parallel_trainer`` wraps the resident trainer."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch.distributed as dist

from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.leaves import Start
from nanotrain.data_parallel.config import DPConfig, check_split
from nanotrain.data_parallel.trainer import DataParallelTrainer
from nanotrain.distributed import Group
from nanotrain.stream.config import StreamConfig
from nanotrain.stream.sharded import ShardedStreamedAdam
from nanotrain.stream.trainer import StreamTrainer


def zero_offload_trainer(cfg: Any, params: Start, scfg: StreamConfig, adam: AdamConfig, ocfg: OffloadConfig,
                         dcfg: DPConfig, group: Group) -> DataParallelTrainer:
    """A ``StreamTrainer`` over the global batch ``scfg.batch``, its data split over ``group``, its state sharded:
    ZeRO-2 with the state in host memory, whatever ``dcfg.zero`` says (its other settings hold)."""
    world = dist.get_world_size(group)
    check_split(scfg.batch, scfg.micro_batch, world)
    inner = StreamTrainer(cfg, params, replace(scfg, batch=scfg.batch // world), adam, ocfg,
                          make_opt=lambda p, units, hp, oc: ShardedStreamedAdam(p, units, hp, oc, group))
    return DataParallelTrainer(inner, group, scfg.batch, scfg.micro_batch, replace(dcfg, zero=2), sums_loss=True)
