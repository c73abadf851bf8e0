"""The ops a block is written against, and the plain set of them.

A family writes its pieces (``ModelSpec.embed``, ``attention``, ``mlp_in``) with these ops only; an
engine supplies the set it needs, so one block serves them all: ``PlainOps``, ``core.lean.LeanOps``,
``tensor_parallel.ops.TPOps``, ``models.cache.CacheOps`` (docs/ARCHITECTURE.md says what each does).

The matmul ops take the normalisation or activation that precedes them, so that an op set can keep
that op's input instead of its output for backward (``LeanOps``), or run it on its token shard
before gathering the tokens (``TPOps``).

Dropout masks are a pure function of a seed: a ``torch.Generator`` seeded per sublayer and drawn in
a fixed order, so recompute, streaming and tensor parallelism replay the single-process masks.
"""
from __future__ import annotations

import copy
import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from nanotrain.core.linear import linear
from nanotrain.core.models.documents import Documents
from nanotrain.core.loss import chunked_cross_entropy, kept_logits_cross_entropy

Norm = Callable[..., torch.Tensor]  # (x, *weights) -> normalised x


def layer_norm(eps: float) -> Norm:
    def norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return norm


def rms_norm(eps: float) -> Norm:
    """RMSNorm as ``transformers`` computes it: in fp32, cast back to the input's dtype, then scaled."""
    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return w * y.to(x.dtype)
    return norm


def gelu_tanh(u: torch.Tensor) -> torch.Tensor:
    return F.gelu(u, approximate="tanh")


def swiglu(u: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused ``[..., gate | up]`` (each half this rank's neurons under TP)."""
    gate, up = u.chunk(2, dim=-1)
    return F.silu(gate) * up


def keep_mask(shape: Sequence[int], p: float, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Which elements of a tensor of ``shape`` dropout keeps, drawn from ``gen``."""
    return torch.rand(tuple(shape), generator=gen, device=device, dtype=torch.float32) >= p


def dropped(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted dropout of ``x`` with the mask ``keep``."""
    return x * keep.to(x.dtype) / (1.0 - p)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def split_heads(qkv: torch.Tensor, heads: int, kv_heads: int,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, T, (H + 2 KV) D]`` -> q ``[B, H, T, D]``, k and v ``[B, KV, T, D]``.

    Split before transposing: backward then writes the three gradients straight into the ``[B, T, ...]``
    layout of ``qkv`` in one copy (transposing first made it stack and permute them once more).
    """
    b, t, _ = qkv.shape
    if heads == kv_heads:
        q, k, v = qkv.view(b, t, 3, heads, head_dim).unbind(2)
    else:
        q, k, v = qkv.view(b, t, heads + 2 * kv_heads, head_dim).split((heads, kv_heads, kv_heads), dim=2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    b, h, t, d = y.shape
    return y.transpose(1, 2).reshape(b, t, h * d)


def expand_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated so that each query head has its own (grouped-query attention)."""
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def causal_weights(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) over each query's own and earlier keys (``allowed``: over those it marks, packed
    rows' block-diagonal mask), written out (for dropout on the weights)."""
    scores = (q @ expand_kv(k, q.shape[1]).transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if allowed is None:
        allowed = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Fused causal attention; key/value heads may be fewer than query heads (each serves a group)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class PlainOps:
    """One device, activations ``[B, T, C]``; ``pos_offset``: the first token's position; ``docs``: the packed rows'
    documents (None: one document per row, attention causal over all of it)."""

    pos_offset = 0
    docs: Documents | None = None

    def packed(self, positions: torch.Tensor | None) -> "PlainOps":
        """These ops for a micro-batch of packed rows whose tokens have ``positions`` in their documents (built into
        the mask once here); themselves for unpacked rows (None)."""
        return self if positions is None else self.with_documents(Documents.of(positions))

    def with_documents(self, docs: Documents | None) -> "PlainOps":
        """A copy carrying ``docs`` (themselves when None: unpacked rows keep the very same op set)."""
        if docs is None:
            return self
        ops = copy.copy(self)
        ops.docs = docs
        return ops

    def embed(self, tokens: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings, plus learned position embeddings when ``wpe`` is given."""
        x = F.embedding(tokens, wte)
        if wpe is None:
            return x
        return x + F.embedding(self.positions(tokens.shape[1], tokens.device), wpe)

    def norm_column(self, x: torch.Tensor, norm: Norm, norm_w: Sequence[torch.Tensor], w: torch.Tensor,
                    b: torch.Tensor | None) -> torch.Tensor:
        """``linear(norm(x), w, b)`` as ``[B, T, out]`` (under TP: this rank's outputs of every token)."""
        return linear(norm(x, *norm_w), w, b)

    def heads(self, heads: int, kv_heads: int) -> tuple[int, int]:
        """The query and key/value heads this op set computes (all of them here)."""
        return heads, kv_heads

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """The positions of the ``t`` tokens (learned position embeddings, rotary embeddings): ``[t]`` absolute, or
        packed ``[B, t]``, each in its document."""
        if self.docs is not None:
            return self.docs.positions
        return torch.arange(self.pos_offset, self.pos_offset + t, device=device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float,
                  gen: torch.Generator | None) -> torch.Tensor:
        """Causal attention ``[B, H, T, D]`` (packed: within each document); with dropout written out so its mask
        comes from ``gen``."""
        if gen is None or p == 0.0:
            return causal_attention(q, k, v) if self.docs is None else self.docs.attention(q, k, v)
        weights = causal_weights(q, k, None if self.docs is None else self.docs.boolean())
        return dropped(weights, self.attention_keep(weights, p, gen), p) @ expand_kv(v, q.shape[1])

    def attention_keep(self, weights: torch.Tensor, p: float, gen: torch.Generator) -> torch.Tensor:
        """The dropout mask of the attention ``weights`` (under TP: this rank's heads of the whole one)."""
        return keep_mask(weights.shape, p, gen, weights.device)

    def row(self, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """``linear(y, w, b)`` back into the residual stream's layout (under TP: summed over ranks)."""
        return linear(y, w, b)

    def act_row(self, u: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor,
                b: torch.Tensor | None) -> torch.Tensor:
        return self.row(act(u), w, b)

    def dropout(self, x: torch.Tensor, p: float, gen: torch.Generator | None) -> torch.Tensor:
        """Dropout of a residual-stream tensor (None: no dropout, as in eval)."""
        return x if gen is None or p == 0.0 else dropped(x, self.residual_keep(x, p, gen), p)

    def residual_keep(self, x: torch.Tensor, p: float, gen: torch.Generator) -> torch.Tensor:
        """The dropout mask of ``x`` (under TP: this rank's tokens of the whole tensor's)."""
        return keep_mask(x.shape, p, gen, x.device)

    def head_loss(self, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, denom: float | None,
                  chunk_tokens: int = 2048, keep_logits: bool = False) -> torch.Tensor:
        """Cross-entropy of ``h @ w.T`` summed over the targets that count, over ``denom``, chunk by chunk.

        ``keep_logits``: keep the logits and compute the gradients in backward (a pipeline's last stage,
        see ``nanotrain.core.loss``); needs ``denom``.
        """
        h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        if keep_logits:
            return kept_logits_cross_entropy(h, w, targets, denom, chunk_tokens)
        return chunked_cross_entropy(h, w, targets, denom=denom, chunk_tokens=chunk_tokens)

    def logits(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(h, w)


PLAIN = PlainOps()
