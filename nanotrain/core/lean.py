"""``LeanOps``: the block's ops, storing less for backward without recomputing any matmul.

Plain autograd keeps, per token and block, the inputs of every matmul (Korthikanti et al. 2022 count
34·C bytes in bf16 for GPT-2). Two kinds of those tensors are cheap elementwise functions of tensors
kept anyway: the normalised inputs of the matmuls that follow a norm, and the activation's output
(the MLP's last matmul's input, the widest of all). ``norm_column`` keeps ``x`` instead of ``norm(x)``
and ``act_row`` keeps ``u`` instead of ``act(u)``; backward redoes the norm or the activation from what
it kept. For GPT-2 a block then keeps about 22·C: a third less memory for a few elementwise kernels,
where full or MLP recompute redoes matmuls. Generic over the norm (LayerNorm with weight and bias,
RMSNorm with a weight) and the activation (tanh GELU, SwiGLU on a fused gate|up): values and gradients
are those of ``PlainOps`` (same ops, same order), dropout included.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from nanotrain.core.linear import linear_grads
from nanotrain.core.models.ops import Norm, PlainOps


class _NormColumn(torch.autograd.Function):
    """``F.linear(norm(x, *norm_w), w, b)`` keeping ``x`` (and the weights) for backward."""

    @staticmethod
    def forward(ctx, norm, x, w, b, *norm_w):  # type: ignore[override]
        ctx.norm, ctx.has_bias = norm, b is not None
        ctx.save_for_backward(x, w, *norm_w)
        return F.linear(norm(x, *norm_w), w, b)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, w, *norm_w = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (x, *norm_w)]
            h = ctx.norm(*leaves)
        dh, dw, db = linear_grads(dy, h.detach(), w)
        dx, *dnorm_w = torch.autograd.grad(h, leaves, dh)
        return None, dx, dw, db if ctx.has_bias else None, *dnorm_w


class _ActRow(torch.autograd.Function):
    """``F.linear(act(u), w, b)`` keeping ``u`` rather than ``act(u)`` for backward."""

    @staticmethod
    def forward(ctx, act, u, w, b):  # type: ignore[override]
        ctx.act, ctx.has_bias = act, b is not None
        ctx.save_for_backward(u, w)
        return F.linear(act(u), w, b)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        u, w = ctx.saved_tensors
        with torch.enable_grad():
            leaf = u.detach().requires_grad_()
            g = ctx.act(leaf)
        dg, dw, db = linear_grads(dy, g.detach(), w)
        (du,) = torch.autograd.grad(g, leaf, dg)
        return None, du, dw, db if ctx.has_bias else None


class LeanOps(PlainOps):
    """``PlainOps`` whose norm-then-matmul and activation-then-matmul keep their inputs, not the
    intermediate, for backward (``core.recompute``'s ``lean`` policy)."""

    def norm_column(self, x: torch.Tensor, norm: Norm, norm_w: Sequence[torch.Tensor], w: torch.Tensor,
                    b: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(w, torch.Tensor):  # a matrix with LoRA pairs: they read norm(x), so it is kept
            return super().norm_column(x, norm, norm_w, w, b)
        return _NormColumn.apply(norm, x, w, b, *norm_w)

    def act_row(self, u: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor,
                b: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(w, torch.Tensor):  # a matrix with LoRA pairs: they read act(u), so it is kept
            return super().act_row(u, act, w, b)
        return _ActRow.apply(act, u, w, b)


LEAN = LeanOps()
