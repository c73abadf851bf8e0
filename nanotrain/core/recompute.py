"""Recompute of a model's blocks, written by hand (not ``torch.utils.checkpoint``), for any ``ModelSpec``.

A recomputed piece runs under ``no_grad`` in the forward pass and keeps only its inputs; its
backward runs it again with autograd on and back-propagates through that fresh graph. Dropout
needs no RNG-state juggling: masks are a pure function of the seed the piece is called with.

Policies (``RecomputePolicy``):
- ``none``: keep every activation (fastest, most memory);
- ``every``: recompute every block, keeping only block inputs (``block_grads``: all of the block
  but its last matmul, whose output backward does not need);
- ``every-k``: recompute blocks 0, k, 2k, ... and keep the others whole;
- ``selective``: keep the attention sublayer's activations, recompute the MLP (whose wide hidden
  activations are the largest, and cheapest to recompute per byte saved);
- ``lean``: recompute no matmul, only the norms and the activation (``nanotrain.core.lean``): about a
  third less memory than ``none`` for a few elementwise kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from nanotrain.core.linear import linear_grads
from nanotrain.core.lean import LEAN
from nanotrain.core.models import lora, run
from nanotrain.core.models.ops import PLAIN, PlainOps
from nanotrain.core.models.spec import ModelSpec
POLICIES = ("none", "every", "every-k", "selective", "lean")



@dataclass(frozen=True)
class BlockFns:
    """``run.block`` and ``run.trunk`` (spec, block params, x, ops, seed) -> (x plus the attention, the MLP's first
    matmul's output), or both compiled (``compiled``). Compiled unbound: a compiled ``functools.partial`` runs in
    torch's one wrapper frame, whose recompile limit every compiled partial of the process would then share."""
    block: Callable[..., torch.Tensor] = run.block
    trunk: Callable[..., tuple[torch.Tensor, torch.Tensor]] = run.trunk

    @classmethod
    def compiled(cls, compile: bool = True) -> "BlockFns":
        if not compile:
            return cls()
        return cls(torch.compile(run.block, dynamic=False), torch.compile(run.trunk, dynamic=False))


@dataclass(frozen=True)
class RecomputePolicy:
    kind: str = "every"
    k: int = 2

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"unknown recompute policy {self.kind!r} (known: {', '.join(POLICIES)})")
        if self.kind == "every-k" and self.k < 1:
            raise ValueError(f"recompute policy every-k needs k >= 1, got {self.k}")

    @classmethod
    def parse(cls, text: str) -> "RecomputePolicy":
        """``none``, ``every``, ``selective``, ``lean`` or ``every-K`` (e.g. ``every-3``)."""
        if text.startswith("every-") and text[6:].isdigit():
            return cls("every-k", int(text[6:]))
        return cls(text)

    def recomputes_block(self, index: int) -> bool:
        return self.kind == "every" or (self.kind == "every-k" and index % self.k == 0)

    def block_fn(self, spec: ModelSpec, compile: bool = False) -> run.BlockFn:
        """``run_units``' ``block_fn``: block ``index`` under this policy, the same values and gradients as
        ``run.block``. ``compile``: ``torch.compile`` the block where the policy recomputes nothing (the
        others' hand-written backward stays eager)."""
        if compile and self.kind == "none":
            compiled = torch.compile(run.block, dynamic=False)
            return lambda p, x, seed, index, ops: compiled(spec, p, x, ops, seed)
        return partial(recomputed_block, spec, self)


def _save(ctx, *items) -> None:
    """``ctx.save_for_backward`` of the tensors among ``items``; the others (a 4-bit base's weights, ``core.nf4``)
    are kept aside, as they are frozen."""
    ctx.others = {i: t for i, t in enumerate(items) if not isinstance(t, torch.Tensor)}
    ctx.save_for_backward(*(t for t in items if isinstance(t, torch.Tensor)))


def _saved(ctx) -> list:
    """What ``_save`` kept, in its order, the tensors detached and needing a gradient as their inputs did."""
    tensors = iter(ctx.saved_tensors)
    return [ctx.others[i] if i in ctx.others else next(tensors).detach().requires_grad_(need)
            for i, need in enumerate(ctx.needs_input_grad[ctx.first:])]


class _Recompute(torch.autograd.Function):
    """Run ``fn(*inputs)`` without keeping its graph; rebuild the graph from ``inputs`` in backward."""

    @staticmethod
    def forward(ctx, fn, *inputs):  # type: ignore[override]
        ctx.fn, ctx.first = fn, 1
        _save(ctx, *inputs)
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        inputs = _saved(ctx)
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        trains = [isinstance(t, torch.Tensor) and t.requires_grad for t in inputs]
        wanted = [t for t, need in zip(inputs, trains) if need]
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
        return (None, *(next(grads) if need else None for need in trains))


def block_grads(spec: ModelSpec, p: dict, x: torch.Tensor, dy: torch.Tensor, seed: int | None,
                fns: BlockFns = BlockFns(),
                ops: PlainOps = PLAIN) -> tuple[torch.Tensor | None, dict[str, torch.Tensor | None]]:
    """Gradients of ``run.block(spec, p, x, ops, seed)`` given its output's gradient ``dy``, recomputing
    the block from ``x`` but stopping short of its last matmul (``spec.mlp_out``).

    The last matmul's output is only ever added to the residual, and its backward reads only its
    input (the activation of the trunk's ``u``) and ``dy``: recomputing it would be wasted. Its dropout
    mask is replayed on ``dy``: the mask is a pure function of the seed. ``fns`` may be compiled (a block with
    adapters, or a 4-bit base, recomputes ``fns.block`` whole). Returns (d x, d each leaf of ``p``); None where the
    tensor does not require a gradient.
    """
    w_key, b_key = spec.mlp_out
    if lora.adapts(spec, w_key) or not isinstance(p[w_key], torch.Tensor):  # pairs, or a 4-bit base: autograd's
        return _autograd_grads(spec, p, x, dy, seed, ops, fns.block)
    with torch.enable_grad():
        h, u = fns.trunk(spec, p, x, ops, seed)
        g = spec.act(u)
    dz = ops.dropout(dy, spec.dropout.residual, run.generators(seed, dy.device)[1])
    dg, dw, db = linear_grads(dz, g.detach(), p[w_key])
    last = {w_key: dw} | ({b_key: db} if b_key else {})
    wanted = [t for t in (x, *(w for k, w in p.items() if k not in last)) if t.requires_grad]
    found = iter(torch.autograd.grad((h, g), wanted, (dy, dg)))
    dx = next(found) if x.requires_grad else None
    grads = {k: (last[k] if k in last else next(found)) if w.requires_grad else None for k, w in p.items()}
    return dx, grads


def _autograd_grads(spec: ModelSpec, p: dict, x: torch.Tensor, dy: torch.Tensor, seed: int | None,
                    ops: PlainOps, block: Callable[..., torch.Tensor]
                    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor | None]]:
    """``block_grads`` by a whole recomputed ``block`` and autograd (``ops`` carry a packed micro-batch's
    documents)."""
    with torch.enable_grad():
        y = block(spec, p, x, ops, seed)
    trains = lambda t: isinstance(t, torch.Tensor) and t.requires_grad  # noqa: E731 (a 4-bit base is no tensor)
    found = iter(torch.autograd.grad(y, [t for t in (x, *p.values()) if trains(t)], dy))
    dx = next(found) if x.requires_grad else None
    return dx, {k: next(found) if trains(w) else None for k, w in p.items()}


class _RecomputedBlock(torch.autograd.Function):
    """A block that keeps only its input and weights; backward is ``block_grads``."""

    @staticmethod
    def forward(ctx, spec, seed, ops, keys, x, *ws):  # type: ignore[override]
        ctx.spec, ctx.seed, ctx.ops, ctx.keys, ctx.first = spec, seed, ops, keys, 4
        _save(ctx, x, *ws)
        with torch.no_grad():
            return run.block(spec, dict(zip(keys, ws)), x, ops, seed)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, *ws = _saved(ctx)
        dx, grads = block_grads(ctx.spec, dict(zip(ctx.keys, ws)), x, dy, ctx.seed, ops=ctx.ops)
        return (None, None, None, None, dx, *grads.values())


def recompute(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)`` whose intermediate activations are recomputed in backward instead of stored.

    Every tensor ``fn`` reads that needs a gradient must be among ``inputs``.
    """
    return _Recompute.apply(fn, *inputs)


def recomputed_block(spec: ModelSpec, policy: RecomputePolicy, p: dict, x: torch.Tensor, seed: int | None,
                     index: int, ops: PlainOps = PLAIN) -> torch.Tensor:
    """``run.block`` with the plain ``ops`` (a packed micro-batch's carry its documents) under ``policy`` for block
    number ``index``: the same values and gradients."""
    if policy.recomputes_block(index):
        return _RecomputedBlock.apply(spec, seed, ops, list(p), x, *p.values())
    if policy.kind == "lean":
        return run.block(spec, p, x, LEAN.with_documents(ops.docs), seed)
    if policy.kind != "selective":
        return run.block(spec, p, x, ops, seed)
    h = run.attention_residual(spec, p, x, ops, run.generators(seed, x.device)[0])
    keys = spec.mlp_keys

    def mlp(h: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:  # a fresh generator replays the mask
        return run.mlp(spec, dict(zip(keys, ws)), h, ops, run.generators(seed, h.device)[1])

    return h + recompute(mlp, h, *(p[k] for k in keys))
