"""Backward split into an input-gradient pass (I) and a weight-gradient pass (W), exactly.

Under ``DeferWeightGrads(pending)`` every ``F.linear`` whose weight needs a gradient runs as a
linear whose backward computes the gradients of its input and bias only, and appends
(weight, input, grad_output) to ``pending``. A normal ``torch.autograd.backward`` is then the I
pass: it walks the whole graph, produces the stage input's gradient (to send upstream at once)
and the cheap gradients (norms, biases, embeddings), and frees the graph. ``apply_weight_grads``
is the W pass: grad_weight = grad_output^T @ input per linear, the matmul autograd would have
run, just later. The alternative of two ``autograd.grad`` calls (inputs, then params) would
walk the graph twice and redo the input-gradient matmuls in W. Weights used other than through
``F.linear`` (convolutions, the tied LM head) get their gradient in I, which is still exact.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

Pending = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class _LinearWeightGradLater(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, pending):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.pending, ctx.has_bias = pending, b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w = ctx.saved_tensors
        gx = grad @ w if ctx.needs_input_grad[0] else None
        gb = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[1]:
            ctx.pending.append((w, x, grad))
        return gx, None, gb, None


class DeferWeightGrads(TorchFunctionMode):
    def __init__(self, pending: Pending):
        super().__init__()
        self.pending = pending

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if w.requires_grad:
                return _LinearWeightGradLater.apply(x, w, b, self.pending)
        return func(*args, **kwargs)


def apply_weight_grads(pending: Pending) -> None:
    """The W pass: accumulate every deferred weight gradient (through any cast or view of the weight)."""
    if not pending:
        return
    weights = [w for w, _, _ in pending]
    grads = [g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) for _, x, g in pending]
    pending.clear()
    torch.autograd.backward(weights, grads)
