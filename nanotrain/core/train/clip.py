"""Gradient clipping by global norm, as ``torch.nn.utils.clip_grad_norm_`` does it, across ranks too.

The global norm is the 2-norm of every gradient of the model, each parameter counted once: a
trainer whose parameters are spread over ranks passes the ranks' group, and leaves out of
``grads`` the copies that another rank counts (a pipeline's tied embedding on its last stage);
tensor parallelism, whose replicated parameters are on every rank, has ``tensor_parallel.grad_norm``.
The factor is torch's, ``min(1, max_norm / (norm + 1e-6))``, applied to every gradient.

A non-finite norm makes every gradient NaN instead of zero: the optimizer then skips the whole
step, as it skips any step with a non-finite gradient, rather than applying a half-zeroed one.

Why the offloaded and streamed trainers differ: their updates start while backward still runs,
before the norm is known. The resident trainer with ``OffloadConfig(exact_skip=True)`` (fp16 runs
have it) keeps that overlap: it sums each unit's squared norm as it hands the unit over, the
optimizer updates speculatively into its second copy of masters and moments, and a step whose norm
turns out over the threshold is redone from the copy swapped out at its commit
(``optim.clip_redo``: what that costs). Without ``exact_skip`` it hands its units over after the
whole backward (exact, no extra memory; the update no longer overlaps backward). The streamed
trainer defers every update to a pass after the backward (``stream.deferred``: why it does not speculate).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nanotrain.core.train.result import StepResult
EPS = 1e-6  # torch's clip_grad_norm_


def global_norm(grads: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """sqrt(sum of squares) of ``grads`` (fp32), summed over ``group``'s ranks when given."""
    squares = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).square().sum()
    if group is not None:
        dist.all_reduce(squares, group=group)
    return squares.sqrt()


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's factor, or NaN for a non-finite norm (so the step is skipped whole)."""
    factor = (max_norm / (norm + EPS)).clamp(max=1.0)
    return torch.where(torch.isfinite(norm), factor, torch.full_like(factor, float("nan")))


def clip_(grads: list[torch.Tensor], max_norm: float, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale ``grads`` in place to a global norm of at most ``max_norm`` (over ``group``'s ranks, each holding a
    part of them, when given); the norm before clipping."""
    norm = global_norm(grads, group)
    factor = clip_factor(norm, max_norm)
    for g in grads:
        g.mul_(factor)
    return norm


def clipped_result(loss: float, tokens: int, norm: torch.Tensor | float | None, max_norm: float | None) -> StepResult:
    """A step's result: skipped when its loss or its gradient norm (where taken: clipping, fp16's overflow check)
    is not finite; the norm before clipping, and whether it clipped, where the step clips."""
    value = None if norm is None else float(norm)
    result = StepResult(loss, not math.isfinite(loss) or value is not None and not math.isfinite(value), tokens)
    if value is not None and max_norm is not None:
        result.grad_norm, result.clipped = value, value > max_norm
    return result
