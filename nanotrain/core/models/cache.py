"""The key/value-cache op set: generation runs every family's own block with it (``nanotrain.core.generate``).

Each block gets a ``CacheOps`` holding its own cache; ``pos_offset`` is the position of the step's first
token, so the learned-position ``embed`` and the rotary ``positions`` (``PlainOps``) continue where the
cache ends, and ``attention`` writes the step's keys and values there before attending to all of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanotrain.core.models.ops import PlainOps
from nanotrain.core.models.spec import ModelSpec
@dataclass(frozen=True)
class KVCache:
    """One block's keys and values, ``[B, KV heads, length, head dim]``, filled up to the step's position."""
    k: torch.Tensor
    v: torch.Tensor


def empty_caches(spec: ModelSpec, batch: int, length: int, like: torch.Tensor) -> list[KVCache]:
    """A cache per block for ``length`` tokens, in ``like``'s dtype and on its device."""
    _, kv_heads, head_dim = spec.heads
    shape = (batch, kv_heads, length, head_dim)
    return [KVCache(like.new_empty(shape), like.new_empty(shape)) for _ in spec.block_units]


class CacheOps(PlainOps):
    """Plain ops for tokens at positions ``[pos_offset, pos_offset + T)``; ``cache``: the block's (None for
    the embedding and the head, which attend to nothing)."""

    def __init__(self, pos_offset: int, cache: KVCache | None = None):
        self.pos_offset = pos_offset
        self.cache = cache

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float,
                  gen: torch.Generator | None) -> torch.Tensor:
        """Causal attention over the cache and the step's tokens (no dropout: generation is evaluation).

        Key/value heads may be fewer than query heads: each serves its group (grouped-query attention).
        """
        pos, t = self.pos_offset, q.shape[-2]
        self.cache.k[:, :, pos:pos + t] = k
        self.cache.v[:, :, pos:pos + t] = v
        keys, values = self.cache.k[:, :, :pos + t], self.cache.v[:, :, :pos + t]
        # Query i sits at position pos + i and may see keys 0 .. pos + i.
        mask = torch.ones(t, pos + t, dtype=torch.bool, device=q.device).tril(diagonal=pos)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
