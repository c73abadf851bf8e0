"""One pipeline training step: run the schedule, sum tied gradients, share the loss, step."""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanotrain.pipeline.build import Pipeline
from nanotrain.pipeline.executor import Timer, run_step
from nanotrain.pipeline.memory import ActivationMeter
from nanotrain.core.tree import get_path
def finish_grads(pipe: Pipeline, loss: torch.Tensor) -> torch.Tensor:
    """Sum the gradients of tied copies (GPT-2's embedding and LM head); every rank of the pipeline gets the loss.

    Nothing here waits for the device: the host can queue the next step while this one runs.
    """
    for path, group in pipe.tied:
        p = get_path(pipe.params, path)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
    return share_loss(pipe, loss)


def share_loss(pipe: Pipeline, loss: torch.Tensor) -> torch.Tensor:
    """The last stage's loss, broadcast in place to every rank of the pipeline."""
    last = pipe.schedule.rank_of(pipe.schedule.n_stages - 1)
    dist.broadcast(loss, src=pipe.global_rank(last), group=pipe.ctx.grid.pp_group)
    return loss


def train_step(pipe: Pipeline, optimizer: torch.optim.Optimizer | None, inputs: torch.Tensor, targets: torch.Tensor,
               meter: ActivationMeter | None = None, timer: Timer | None = None,
               loss_scale: float | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Zero grads, forward/backward every micro-batch, reduce tied grads, then ``optimizer.step()``.

    Returns the batch's mean loss on every rank as a 0-dim tensor on its device; ``float()`` it
    only when logging, since that waits for the step to finish. ``optimizer=None`` leaves the
    gradients in place. ``positions``: packed rows' (``run_step``).
    """
    for p in pipe.parameters():
        p.grad = None
    with pipe.ctx.guard():
        loss = run_step(pipe, inputs, targets, meter, timer, loss_scale=loss_scale, positions=positions)
        pipe.ctx.where = "the tied-gradient all-reduce and loss broadcast"
        value = finish_grads(pipe, loss)
        if optimizer is not None:
            pipe.ctx.where = "the optimizer step"
            optimizer.step()
    pipe.ctx.where = "between steps"
    return value
