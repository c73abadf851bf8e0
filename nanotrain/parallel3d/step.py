"""One 3D-parallel training step: a tensor-parallel pipeline per data-parallel replica.

Every rank gets the same global batch (a pure function of the step) and keeps its replica's
contiguous slice, cut into the schedule's micro-batches. The loss denominator is the *global*
batch's count of valid targets: replica r's loss is its summed cross-entropy over that count, so
the sum of the replicas' gradients is exactly the whole batch's, however the ignored targets
(-100) fall between replicas.

The gradients are finished by three sums over three groups (``grad_sync.GradSync``): the
sequence-parallel partial sums of replicated leaves over TP and the sum over DP, both started as
soon as a stage's last backward of the step is done (the pipeline's ``on_stage_done``), so the DP
reduction overlaps the cool-down; then, once the schedule has run, the tied embedding's copies
between the first and the last stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist

from nanotrain.distributed import DistContext, RankGrid
from nanotrain.parallel3d.grad_sync import GradSync
from nanotrain.parallel3d.layered import tp_layered
from nanotrain.pipeline.build import Pipeline, build_pipeline
from nanotrain.pipeline.executor import Timer, run_step
from nanotrain.pipeline.schedule import Schedule
from nanotrain.pipeline.train import share_loss
from nanotrain.tensor_parallel.shard import TPPlan, plan_tp
from nanotrain.train.step import batch_denominator


class Optimizer(Protocol):
    """A torch optimizer over ``Parallel3D.parameters()``, or ``optimizer.Adam3D``."""

    def step(self) -> None: ...


@dataclass
class Parallel3D:
    pipe: Pipeline  # this rank's stages, over its TP shard of their leaves
    plan: TPPlan
    seq_len: int
    sync: GradSync

    @property
    def grid(self) -> RankGrid:
        return self.pipe.ctx.grid

    def parameters(self) -> list[torch.Tensor]:
        return self.pipe.parameters()

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return self.pipe.named_parameters()


def build_3d(ctx: DistContext, cfg: Any, schedule: Schedule, seq_len: int, micro_batch: int,
             sequence_parallel: bool = False, sublayers: bool = False, recompute: bool = False,
             counts: Sequence[int] | None = None, seed: int = 0, dtype: torch.dtype = torch.float32) -> Parallel3D:
    """This rank's share of the model (any family's config) on ``ctx.grid``: its pipeline stages,
    tensor-parallel, initialised as ``models.init_params(cfg, seed)`` would be, then sharded. Every rank of the
    world must call it."""
    if sequence_parallel and (micro_batch * seq_len) % ctx.grid.tp:
        raise ValueError(f"sequence parallelism splits a micro-batch's {micro_batch} x {seq_len} tokens over "
                         f"tp={ctx.grid.tp}; make micro_batch * seq_len a multiple of {ctx.grid.tp}")
    plan = plan_tp(cfg, ctx.grid, sequence_parallel)
    model = tp_layered(plan, seq_len, sublayers, recompute)
    example = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    pipe = build_pipeline(ctx, model, schedule, example, counts, seed, dtype)
    return Parallel3D(pipe, plan, seq_len, GradSync(pipe, plan))


def replica_slice(batch: torch.Tensor, grid: RankGrid, n_microbatches: int) -> torch.Tensor:
    """This replica's contiguous share of ``[B, ...]`` as ``[micro-batches, B / (dp * micro-batches), ...]``."""
    b, parts = batch.shape[0], grid.dp * n_microbatches
    if b % parts:
        raise ValueError(f"a global batch of {b} sequences does not split into dp={grid.dp} replicas x "
                         f"{n_microbatches} micro-batches; use a multiple of {parts}")
    share = b // grid.dp
    mine = batch[grid.dp_rank * share:(grid.dp_rank + 1) * share]
    return mine.reshape(n_microbatches, share // n_microbatches, *batch.shape[1:])


def grads_3d(p3d: Parallel3D, tokens: torch.Tensor, targets: torch.Tensor, timer: Timer | None = None) -> torch.Tensor:
    """Forward and backward of the global batch ``[B, seq]``; this rank's gradients finished (in ``.grad``,
    or under a sharded optimizer this rank's shards in ``p3d.sync``). ``timer``: the executor's, around
    each action of the schedule.

    Returns the global batch's mean loss on every rank (a 0-dim tensor; ``float()`` waits for it).
    """
    pipe, grid, sync = p3d.pipe, p3d.grid, p3d.sync
    sync.begin()
    m = pipe.schedule.n_microbatches
    denom = batch_denominator(tokens, targets, tokens.shape[0], p3d.plan.spec)
    with pipe.ctx.guard():
        loss = run_step(pipe, replica_slice(tokens, grid, m), replica_slice(targets, grid, m), timer=timer,
                        denom=denom, on_stage_done=sync.stage_done)
        pipe.ctx.where = "the data-parallel gradient sums and the tied-gradient all-reduce"
        sync.finish()
        pipe.ctx.where = "the loss broadcast"
        share_loss(pipe, loss)
        dist.all_reduce(loss, group=grid.dp_group)
    pipe.ctx.where = "between steps"
    return loss


def update_3d(p3d: Parallel3D, optimizer: Optimizer) -> None:
    """``optimizer.step()`` after ``grads_3d``: every copy of a leaf (tied, replicated over TP or DP) has
    the same gradient, so the copies stay equal through any elementwise optimizer."""
    with p3d.pipe.ctx.guard():
        p3d.pipe.ctx.where = "the optimizer step"
        optimizer.step()
    p3d.pipe.ctx.where = "between steps"


def train_step_3d(p3d: Parallel3D, optimizer: Optimizer, tokens: torch.Tensor,
                  targets: torch.Tensor) -> torch.Tensor:
    """``grads_3d`` then ``update_3d``; the global batch's mean loss."""
    loss = grads_3d(p3d, tokens, targets)
    update_3d(p3d, optimizer)
    return loss
