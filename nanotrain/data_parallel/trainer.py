"""A data-parallel trainer: each rank trains on its slice of every global batch, one optimizer step for all.

``DataParallelTrainer`` is a ``Trainer`` (``train.step``) that every rank of the data-parallel
group runs on the same global batch. Rank ``r`` of ``n`` takes rows ``[r * B / n, (r + 1) * B / n)``,
runs them through its ``ResidentTrainer`` (or ``StreamTrainer``) in micro-batches, and divides its
loss by the target count of the *whole* batch, so that summing gradients (``DataParallelAdam``) and
losses over the ranks gives exactly what one process computes on the whole batch. Dropout seeds
follow the global micro-batch index, so runs with dropout agree too. What the inner trainer says of
the step (gradient norm and clipping, fp16's loss scale and skips) is the same on every rank: it is
taken from the reduced gradients.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from nanotrain.data_parallel import comms
from nanotrain.data_parallel.buckets import Bucket
from nanotrain.data_parallel.config import DPConfig
from nanotrain.data_parallel.optimizer import DataParallelAdam
from nanotrain.data_parallel.streamed import ShardedStreamedAdam
from nanotrain.data_parallel.zero3 import Zero3Trainer
from nanotrain.distributed import Group
from nanotrain.optim import AdamConfig, OffloadConfig
from nanotrain.train.resident import ResidentTrainer, TrainConfig
from nanotrain.train.scaler import split_state
from nanotrain.train.streamed import StreamConfig, StreamTrainer
from nanotrain.train.step import StepResult, batch_denominator, masters_tree
from nanotrain.tree import Tree


def check_split(batch: int, micro_batch: int, world: int) -> None:
    """A global batch must split into ``world`` equal slices of whole micro-batches."""
    unit = world * micro_batch
    if batch % unit:
        fits = [m for m in range(1, batch // world + 1) if batch % (world * m) == 0]
        other = f" or a micro-batch of {', '.join(map(str, fits))}" if fits else ""
        raise ValueError(f"batch {batch} does not split over {world} data-parallel ranks in micro-batches of "
                         f"{micro_batch}: it must be a multiple of {world} x {micro_batch} = {unit}; use a batch of "
                         f"{-(-batch // unit) * unit}{other}")


class DataParallelTrainer:
    """Runs ``inner`` (built for the local slice) on this rank's rows of each global batch."""

    def __init__(self, inner: ResidentTrainer | Zero3Trainer | StreamTrainer, group: Group, batch: int, dcfg: DPConfig):
        self.inner, self.group, self.batch, self.dcfg = inner, group, batch, dcfg
        self.cfg, self.spec = inner.cfg, inner.spec
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._streamed = isinstance(inner, StreamTrainer)
        micro = inner.scfg.micro_batch if self._streamed else inner.tcfg.micro_batch
        check_split(batch, micro, self.world)
        self.rows = batch // self.world
        inner.first_micro = self.rank * (self.rows // micro)
        self.opt = inner.opt
        self._sharded = inner if isinstance(inner, Zero3Trainer) else inner.opt  # who holds the shards
        self._state: tuple[int, dict[str, torch.Tensor]] | None = None

    @property
    def step_count(self) -> int:
        return self.inner.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.inner.step_count = value

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> StepResult:
        """One optimizer step on the global batch ``tokens``/``targets`` ([batch, seq], the same on every rank)."""
        self._state = None
        denom = batch_denominator(tokens, targets, self.batch, self.spec)
        mine = slice(self.rank * self.rows, (self.rank + 1) * self.rows)
        result = self.inner.step(tokens[mine], targets[mine], denom=denom)
        # The streamed trainer sums the loss over the ranks itself, before it decides to skip a step.
        loss = result.loss if self._streamed else comms.sum_value(result.loss, self.group, self.inner.device)
        if self.dcfg.check_replicas:
            self.opt.check_replicas()
        finite = math.isfinite(loss)  # a rank's non-finite loss made every rank skip the step
        return replace(result, loss=loss, skipped=result.skipped or not finite, tokens=denom,
                       overflow=result.overflow and finite)

    def set_lr(self, lr: float) -> None:
        self.inner.set_lr(lr)

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The global batch's mean loss: each rank's rows summed over the group (the same on every rank)."""
        if isinstance(self.inner, Zero3Trainer):
            raise ValueError("validation under --zero 3 is not built (it would gather every unit once more); "
                             "evaluate with --zero 0, 1 or 2")
        mine = slice(self.rank * self.rows, (self.rank + 1) * self.rows)
        local = batch_denominator(tokens[mine], targets[mine], self.rows, self.spec)
        mean = self.inner.eval_loss(tokens[mine], targets[mine])
        return comms.sum_value(mean * local, self.group, self.inner.device) / batch_denominator(
            tokens, targets, self.batch, self.spec)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The single-process state (see ``DataParallelAdam.state_dict``). Every rank must call it (ZeRO
        gathers); it is gathered once per step, however often it is then asked for."""
        if self._state is None or self._state[0] != self.step_count:
            state = self.inner.state_dict()  # under ZeRO the others have (at most) the loss scaler's entries
            self._state = (self.step_count, state if self.rank == 0 or not self.dcfg.zero else {})
        return self._state[1]

    def master_params(self) -> Tree:
        return masters_tree(self.spec, self.state_dict())

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._state = None
        self.inner.load_state_dict(state)

    # -- sharded checkpoints (checkpoint.py) --------------------------------------------------

    @property
    def buckets(self) -> list[Bucket]:
        return self._sharded.buckets

    def shard_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards, and fp16's loss-scaler state (the same on every rank)."""
        return self._sharded.shard_state_dict() | (self.inner.scaler.state_dict() if self.inner.scaler else {})

    def load_shard_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self._state = None
        shards, scaler = split_state(sd)
        self._sharded.load_shard_state_dict(shards)
        if self.inner.scaler:
            self.inner.scaler.load_state_dict(scaler)

    def close(self) -> None:
        self.inner.close()


def data_parallel_trainer(cfg: Any, params: Tree, tcfg: TrainConfig | StreamConfig, adam: AdamConfig,
                          ocfg: OffloadConfig, dcfg: DPConfig, group: Group) -> DataParallelTrainer:
    """A ``ResidentTrainer`` over the global batch ``tcfg.batch``, its data split over ``group`` and its
    gradients reduced (and with ZeRO its optimizer state sharded) by ``DataParallelAdam``. With a
    ``StreamConfig``, a ``StreamTrainer`` whose masters and moments are sharded (``streamed.py``: ZeRO-2
    with the state in host memory, whatever ``dcfg.zero`` says)."""
    world = dist.get_world_size(group)
    check_split(tcfg.batch, tcfg.micro_batch, world)
    local = replace(tcfg, batch=tcfg.batch // world)
    if isinstance(tcfg, StreamConfig):
        inner = StreamTrainer(cfg, params, local, adam, ocfg,
                              make_opt=lambda p, units, hp, oc: ShardedStreamedAdam(p, units, hp, oc, group))
        return DataParallelTrainer(inner, group, tcfg.batch, replace(dcfg, zero=2))
    if dcfg.zero == 3:
        inner = Zero3Trainer(cfg, params, local, adam, ocfg, group)
    else:
        inner = ResidentTrainer(cfg, params, local, adam, ocfg,
                                make_opt=lambda p, units, hp, oc: DataParallelAdam(p, units, hp, oc, group, dcfg,
                                                                                     copy=False,
                                                                                     clip_norm=tcfg.clip_norm))
    return DataParallelTrainer(inner, group, tcfg.batch, dcfg)
