"""A data-parallel trainer: each rank trains on its slice of every global batch, one optimizer step for all.

``DataParallelTrainer`` is a ``Trainer`` (``train.step``) that every rank of the data-parallel
group runs on the same global batch. Rank ``r`` of ``n`` takes rows ``[r * B / n, (r + 1) * B / n)``,
runs them through its ``ResidentTrainer`` (under ZeRO-3 with gathered weights, ``zero3.py``) or
``StreamTrainer`` in micro-batches, and divides its loss by the target count of the *whole* batch, so
that summing gradients (``DataParallelAdam``) and losses over the ranks gives exactly what one process
computes on the whole batch. Dropout seeds follow the global micro-batch index, so runs with dropout
agree too. What the inner trainer says of the step (gradient norm and clipping, fp16's loss scale and
skips) is the same on every rank: it is taken from the reduced gradients.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from nanotrain.data_parallel import comms
from nanotrain.data_parallel.config import DPConfig, check_split
from nanotrain.data_parallel.optimizer import DataParallelAdam
from nanotrain.core.train.shard import ShardState
from nanotrain.data_parallel.zero3 import GatheredWeights
from nanotrain.distributed import Group
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.resident import ResidentTrainer, ResidentWeights, TrainConfig
from nanotrain.core.train.scaler import split_state
from nanotrain.core.train.result import StepResult
from nanotrain.core.train.step import Trainer, batch_denominator, masters_tree
from nanotrain.core.leaves import Start
from nanotrain.core.tree import Tree


class DataParallelTrainer:
    """Runs ``inner`` (built for the local slice, in micro-batches of ``micro_batch``: ``data_parallel_trainer``
    checks the split) on this rank's rows of each global batch. ``inner.opt`` holds this rank's state
    (``shard_state``); ``sums_loss``: ``inner`` reports the whole batch's loss itself (the streamed trainer sums
    it over the ranks before deciding to skip)."""

    def __init__(self, inner: Trainer, group: Group, batch: int, micro_batch: int, dcfg: DPConfig,
                 sums_loss: bool = False):
        self.inner, self.group, self.batch, self.dcfg, self.sums_loss = inner, group, batch, dcfg, sums_loss
        self.cfg, self.spec = inner.cfg, inner.spec
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.rows = batch // self.world
        self.mine = slice(self.rank * self.rows, (self.rank + 1) * self.rows)  # this rank's rows of a global batch
        inner.first_micro = self.rank * (self.rows // micro_batch)
        self.opt = inner.opt
        self._state: tuple[int, dict[str, torch.Tensor]] | None = None

    @property
    def step_count(self) -> int:
        return self.inner.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.inner.step_count = value

    @property
    def layout(self) -> dict:
        """How the state is laid out, as a checkpoint's manifest says it."""
        return {"dp": self.world, "zero": self.dcfg.zero}

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> StepResult:
        """One optimizer step on the global batch ``tokens``/``targets`` ([batch, seq], the same on every rank;
        packed rows with their ``positions``, whose rows go with them)."""
        self._state = None
        denom = batch_denominator(tokens, targets, self.batch, self.spec, positions)
        result = self.inner.step(tokens[self.mine], targets[self.mine], self._mine(positions), denom=denom)
        loss = result.loss if self.sums_loss else comms.sum_value(result.loss, self.group, self.inner.device)
        if self.dcfg.check_replicas:
            self.opt.check_replicas()
        finite = math.isfinite(loss)  # a rank's non-finite loss made every rank skip the step
        return replace(result, loss=loss, skipped=result.skipped or not finite, tokens=denom,
                       overflow=result.overflow and finite)

    def set_lr(self, lr: float) -> None:
        self.inner.set_lr(lr)

    def _mine(self, positions: torch.Tensor | None) -> torch.Tensor | None:
        return None if positions is None else positions[self.mine]

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> float:
        """The global batch's mean loss: each rank's rows summed over the group (the same on every rank). Every rank
        runs as many micro-batches (``check_split``), as ZeRO-3's gathering over the group needs."""
        local = batch_denominator(tokens[self.mine], targets[self.mine], self.rows, self.spec)
        mean = self.inner.eval_loss(tokens[self.mine], targets[self.mine], self._mine(positions))
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

    # -- checkpoints (nanotrain.checkpoint) ----------------------------------------------------

    def shard_state(self) -> ShardState:
        """This rank's pieces, and fp16's loss-scaler state (the same on every rank)."""
        state = self.opt.shard_state()
        state.entries |= self.inner.scaler.state_dict() if self.inner.scaler else {}
        state.group, state.layout = self.group, self.layout
        return state

    def load_shard_state(self, entries: dict[str, torch.Tensor]) -> None:
        self._state = None
        shards, scaler = split_state(entries)
        self.opt.load_shard_state(shards)
        if self.inner.scaler:
            self.inner.scaler.load_state_dict(scaler)

    def close(self) -> None:
        self.inner.close()


def data_parallel_trainer(cfg: Any, params: Start, tcfg: TrainConfig, adam: AdamConfig, ocfg: OffloadConfig,
                          dcfg: DPConfig, group: Group) -> DataParallelTrainer:
    """A ``ResidentTrainer`` over the global batch ``tcfg.batch``, its data split over ``group`` and its
    gradients reduced (and with ZeRO its optimizer state sharded) by ``DataParallelAdam``; under ZeRO-3 its
    weights sharded too (``GatheredWeights``). ``params``: the model's leaves (``core.leaves``), each read once and
    cut to what this rank keeps as it comes (no rank builds the fp32 tree), or a tree they are taken from.
    The streamed trainer's is ZeRO-Offload's (``stream.zero_offload``)."""
    world = dist.get_world_size(group)
    check_split(tcfg.batch, tcfg.micro_batch, world)
    local = replace(tcfg, batch=tcfg.batch // world)
    if dcfg.zero == 3:
        weights = functools.partial(GatheredWeights, group=group, hold=dcfg.hold)
    else:
        weights = functools.partial(ResidentWeights, make_opt=lambda p, units, hp, oc: DataParallelAdam(
            p, units, hp, oc, group, dcfg, copy=False, clip_norm=tcfg.clip_norm))
    return DataParallelTrainer(ResidentTrainer(cfg, params, local, adam, ocfg, weights), group, tcfg.batch,
                               tcfg.micro_batch, dcfg)
