"""Manual activation checkpointing of GPT-2 blocks (not ``torch.utils.checkpoint``).

A checkpointed piece runs under ``no_grad`` in the forward pass and keeps only its inputs; its
backward runs it again with autograd on and back-propagates through that fresh graph. Dropout
needs no RNG-state juggling: masks are a pure function of the seed the piece is called with.

Policies (``CheckpointPolicy``):
- ``none``: keep every activation (fastest, most memory);
- ``every``: recompute every block, keeping only block inputs (``block_grads``: all of the block
  but its last matmul, whose output backward does not need);
- ``every-k``: recompute blocks 0, k, 2k, ... and keep the others whole;
- ``selective``: keep the attention sub-layer's activations, recompute the MLP (whose 4x-wide
  hidden activations are the largest, and cheapest to recompute per byte saved);
- ``lean``: recompute no matmul, only the LayerNorms and the GELU (``nanotrain.memory.lean``): about a
  third less memory than ``none`` for a few elementwise kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from nanotrain import model as M
from nanotrain.models.gpt2 import GPT2Config
from nanotrain.memory.lean import lean_block
from nanotrain.linear import linear_grads

POLICIES = ("none", "every", "every-k", "selective", "lean")


@dataclass(frozen=True)
class CheckpointPolicy:
    kind: str = "every"
    k: int = 2

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"unknown checkpoint policy {self.kind!r} (known: {', '.join(POLICIES)})")
        if self.kind == "every-k" and self.k < 1:
            raise ValueError(f"checkpoint policy every-k needs k >= 1, got {self.k}")

    @classmethod
    def parse(cls, text: str) -> "CheckpointPolicy":
        """``none``, ``every``, ``selective``, ``lean`` or ``every-K`` (e.g. ``every-3``)."""
        if text.startswith("every-") and text[6:].isdigit():
            return cls("every-k", int(text[6:]))
        return cls(text)

    def recomputes_block(self, index: int) -> bool:
        return self.kind == "every" or (self.kind == "every-k" and index % self.k == 0)


class _Recompute(torch.autograd.Function):
    """Run ``fn(*inputs)`` without keeping its graph; rebuild the graph from ``inputs`` in backward."""

    @staticmethod
    def forward(ctx, fn, *inputs):  # type: ignore[override]
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
        return (None, *(next(grads) if t.requires_grad else None for t in inputs))


_LAST_MATMUL = ("fc_proj_w", "fc_proj_b")


def block_grads(p: M.Block, x: torch.Tensor, dy: torch.Tensor, cfg: GPT2Config, seed: int | None,
                trunk: Callable = M.block_trunk) -> tuple[torch.Tensor | None, dict[str, torch.Tensor | None]]:
    """Gradients of ``model.block(p, x, cfg, seed)`` given its output's gradient ``dy``, recomputing
    the block from ``x`` but stopping short of its down projection.

    The down projection's output is only ever added to the residual, and its backward reads only
    its input and ``dy``: recomputing it (a third of the block's matmul FLOPs) would be wasted.
    Its dropout mask is replayed on ``dy``: the mask is a pure function of the seed. ``trunk``
    may be a compiled ``model.block_trunk``. Returns (d x, d each leaf of ``p``); None where the
    tensor does not require a gradient.
    """
    with torch.enable_grad():
        h, g = trunk(p, x, cfg, seed)
    dz = M.dropout(dy, cfg.resid_pdrop, M.make_generator(M.sublayer_seeds(seed)[1], dy.device))
    dg, dw, db = linear_grads(dz, g.detach(), p["fc_proj_w"])
    wanted = [t for t in (x, *(w for k, w in p.items() if k not in _LAST_MATMUL)) if t.requires_grad]
    found = iter(torch.autograd.grad((h, g), wanted, (dy, dg)))
    dx = next(found) if x.requires_grad else None
    last = dict(zip(_LAST_MATMUL, (dw, db)))
    grads = {k: (last[k] if k in last else next(found)) if w.requires_grad else None for k, w in p.items()}
    return dx, grads


class _RecomputedBlock(torch.autograd.Function):
    """A block that keeps only its input and weights; backward is ``block_grads``."""

    @staticmethod
    def forward(ctx, cfg, seed, keys, x, *ws):  # type: ignore[override]
        ctx.cfg, ctx.seed, ctx.keys = cfg, seed, keys
        ctx.save_for_backward(x, *ws)
        with torch.no_grad():
            return M.block(dict(zip(keys, ws)), x, cfg, seed)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, *ws = (t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[3:]))
        dx, grads = block_grads(dict(zip(ctx.keys, ws)), x, dy, ctx.cfg, ctx.seed)
        return (None, None, None, dx, *grads.values())


def recompute(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)`` whose intermediate activations are recomputed in backward instead of stored.

    Every tensor ``fn`` reads that needs a gradient must be among ``inputs``.
    """
    return _Recompute.apply(fn, *inputs)


def checkpointed_block(p: M.Block, x: torch.Tensor, cfg: GPT2Config, seed: int | None, policy: CheckpointPolicy,
                       index: int) -> torch.Tensor:
    """``model.block`` under ``policy`` for block number ``index``: the same values and gradients."""
    keys = list(p)
    if policy.recomputes_block(index):
        return _RecomputedBlock.apply(cfg, seed, keys, x, *p.values())
    if policy.kind == "lean":
        return lean_block(p, x, cfg, seed)
    if policy.kind != "selective":
        return M.block(p, x, cfg, seed)
    seed_attn, seed_mlp = M.sublayer_seeds(seed)
    x = x + M.attention(p, x, cfg, M.make_generator(seed_attn, x.device))
    mlp_keys = [k for k in keys if k.startswith(("ln_2_", "fc_"))]
    mlp = lambda x, *ts: M.mlp(dict(zip(mlp_keys, ts)), x, cfg, M.make_generator(seed_mlp, x.device))  # noqa: E731
    return x + recompute(mlp, x, *(p[k] for k in mlp_keys))
