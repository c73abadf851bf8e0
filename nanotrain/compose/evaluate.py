"""Validation under 3D parallelism: the pipeline's forward alone, without autograd.

The schedules are training schedules (every F has its B), so the forward-only pass is written here in the
plainest order: micro-batch after micro-batch, each through the stages in order, every rank running its
own stages (their TP collectives with the rest of their TP group) and handing each output to the next
stage, by a blocking send to the rank that holds it or in place when that is this rank. Every rank walks
the same global order of (micro-batch, stage), so each receive meets its send and nothing can hang. No
stage overlaps another (the pipeline idles (pp - 1) / pp of the time): validation is a few batches, and
this keeps it free of the executor's bookkeeping. The loss is divided by the global batch's count of valid
targets, summed over the micro-batches on the last stage, broadcast over the pipeline and summed over the
replicas, as a training step does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanotrain.compose.step import replica_slice
from nanotrain.core.models.documents import Documents
from nanotrain.pipeline.build import Pipeline
from nanotrain.pipeline.train import share_loss


def forward_loss(pipe: Pipeline, tokens: torch.Tensor, targets: torch.Tensor, denom: int,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
    """The global batch ``tokens``/``targets`` (the same on every rank; packed rows with their ``positions``) through
    the pipeline, forward only: its summed loss over ``denom``, on every rank."""
    grid, schedule, device = pipe.ctx.grid, pipe.schedule, pipe.ctx.device
    xs, ys = (replica_slice(t, grid, schedule.n_microbatches) for t in (tokens, targets))
    ps = None if positions is None else replica_slice(positions, grid, schedule.n_microbatches)
    loss = torch.zeros((), device=device)
    with torch.no_grad():
        for mb in range(schedule.n_microbatches):
            x = None  # the previous stage's output, when that stage is this rank's too
            docs = None if ps is None else Documents.of(ps[mb].to(device))
            for s in sorted(pipe.stages):
                stage = pipe.stages[s]
                pipe.ctx.where = f"validation: stage {s}, forward of micro-batch {mb}"
                if stage.is_first:
                    x = xs[mb].to(device)
                elif schedule.rank_of(s - 1) != pipe.rank:
                    shape, dtype = pipe.boundaries[s]
                    x = torch.empty(shape, dtype=dtype, device=device)
                    dist.recv(x, pipe.global_rank(schedule.rank_of(s - 1)))
                y = stage.forward(pipe.params, x, ys[mb].to(device) if stage.is_last else None, denom, docs=docs)
                if stage.is_last:
                    loss += y
                elif schedule.rank_of(s + 1) != pipe.rank:
                    dist.send(y.contiguous(), pipe.global_rank(schedule.rank_of(s + 1)))
                x = y
    share_loss(pipe, loss)
    dist.all_reduce(loss, group=grid.dp_group)
    return loss
