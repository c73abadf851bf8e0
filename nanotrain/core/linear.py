"""``linear``: the models' dense layer, ``F.linear`` unless weight gradients are being deferred.

A zero-bubble pipeline splits backward into an input-gradient pass (I) and a later weight-gradient pass
(W), exactly. Under ``deferring_weight_grads(pending)`` every ``linear`` whose weight needs a gradient
computes in backward the gradients of its input and bias only, and appends (weight, input, grad_output)
to ``pending``. A normal ``torch.autograd.backward`` is then the I pass: it walks the whole graph,
produces the stage input's gradient (to send upstream at once) and the cheap gradients (norms, biases,
embeddings), and frees the graph. ``apply_weight_grads`` is the W pass: grad_weight = grad_output^T @
input per linear, the matmul autograd would have run, just later. Two ``autograd.grad`` calls (inputs,
then params) would walk the graph twice and redo the input-gradient matmuls in W. Weights used other
than through ``linear`` (convolutions, the tied LM head) get their gradient in I, which is still exact.

One check of a module attribute per call keeps this off every other op: a ``TorchFunctionMode``
intercepting ``F.linear`` did the same, but ran Python on every torch call of the forward, and the
forward of a gpt2-xl stage became launch-bound (a fifth slower). Not a ``ContextVar``: ``torch.compile``
cannot trace its ``get`` and would break every compiled block's graph at each linear.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F

Pending = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class _Deferral:
    pending: Pending | None = None  # set only inside ``deferring_weight_grads``; one pipeline per process


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


def linear(x: torch.Tensor, w: Any, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + b``; under ``deferring_weight_grads`` the weight's gradient is left to the caller. A ``w`` that
    is no tensor is a frozen one that computes itself: with its adapters (``models.lora.Adapted``), or in 4 bits
    (``core.nf4.NF4Tensor``)."""
    if not isinstance(w, torch.Tensor):
        return w.linear(x, b)
    pending = _Deferral.pending
    if pending is None or not (w.requires_grad and torch.is_grad_enabled()):
        return F.linear(x, w, b)
    return _LinearWeightGradLater.apply(x, w, b, pending)


def linear_grads(dy: torch.Tensor, inp: torch.Tensor,
                 w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d input, d weight, d bias) of ``F.linear(inp, w, b)`` given the output gradient ``dy``."""
    dy2, inp2 = dy.reshape(-1, dy.shape[-1]), inp.reshape(-1, inp.shape[-1])
    return dy @ w, dy2.t() @ inp2, dy2.sum(0)


def deferred_to() -> Pending | None:
    """The list weight gradients are being deferred to right now, if any (for custom layers)."""
    return _Deferral.pending


@contextmanager
def deferring_weight_grads(pending: Pending) -> Iterator[Pending]:
    """Within the block, ``linear``'s weight gradients go to ``pending`` instead of ``.grad``."""
    outer, _Deferral.pending = _Deferral.pending, pending
    try:
        yield pending
    finally:
        _Deferral.pending = outer


def apply_weight_grads(pending: Pending) -> None:
    """The W pass: accumulate every deferred weight gradient (through any cast or view of the weight)."""
    if not pending:
        return
    weights = [w for w, _, _ in pending]
    grads = [g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) for _, x, g in pending]
    pending.clear()
    torch.autograd.backward(weights, grads)
