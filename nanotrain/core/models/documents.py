"""Packed rows: several documents in one row, each attending only to itself, its positions counted from 0.

A packed batch carries, beside its tokens, each token's position in its own document (``[B, T]`` int64): a
document starts wherever the position is 0, so this one tensor says both what the position embeddings read
(learned or rotary) and where the block-diagonal causal mask cuts. An engine passes it through as it passes
the targets (split by rows with them); ``Documents.of`` turns one micro-batch's positions into the mask that
every block of that micro-batch reuses, and the op set carries it (``PlainOps.packed``).

The attention stays a fused kernel: on a GPU FlexAttention with a block mask (compiled once; blocks of
128 x 128 positions that no document spans are skipped), elsewhere SDPA with a boolean ``[B, 1, T, T]`` mask
(torch's CPU kernels take it; the CPU tests run this). A row's trailing padding is one more document, whose
targets are ignored: every query sees at least itself, so no softmax row is empty.

What the planners count does not change: a micro-batch's activations are those of the same ``[B, T]``
unpacked, and the mask is small beside them (a BlockMask holds four int32 tables of at most
``B x (T / 128)^2`` entries, 16 KiB at B = 4, T = 2048; the CPU's boolean mask ``B x T^2`` bytes, 16 MiB there,
is built only where no GPU plan applies). The FLOPs the MFU reading counts stay the full causal square's,
so a packed step's MFU is the unmasked step's work over its time: the blocks FlexAttention skips are not
counted as done.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def check_positions(positions: torch.Tensor, tokens: torch.Tensor) -> None:
    """Positions fit ``tokens`` (``[B, T]`` int64) and describe documents: each row starts one at 0, and each next
    token either starts a document (0) or follows its predecessor (+1)."""
    if positions.shape != tokens.shape or positions.dtype != torch.int64:
        raise ValueError(f"document positions must be int64 of the tokens' shape {tuple(tokens.shape)}, got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    if positions.numel() == 0:
        return
    steps = positions[:, 1:] - positions[:, :-1]
    bad = (positions[:, 0] != 0).any() or ((positions[:, 1:] != 0) & (steps != 1)).any()
    if bad:
        raise ValueError("document positions must start each row at 0 and count up by 1 within a document "
                         "(0 starts the next); build them with data.batches' packed loader")


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: the number of the document each token is in (0, 1, ...), counted along its row."""
    return (positions == 0).cumsum(dim=-1)


def block_diagonal(positions: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` bool: query ``i`` may see key ``j`` when both are in one document and ``j <= i``."""
    doc = document_ids(positions)
    t = positions.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=positions.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def flex_available(device: torch.device) -> bool:
    """FlexAttention runs fused where torch compiles it for the device: CUDA."""
    return device.type == "cuda"


@functools.cache
def _flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def _block_mask(positions: torch.Tensor) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask
    doc = document_ids(positions)

    def same_document(b, h, q, kv):  # FlexAttention's mask_mod: evaluated per (query, key) inside the kernel
        return (doc[b, q] == doc[b, kv]) & (kv <= q)
    b, t = positions.shape
    return create_block_mask(same_document, b, None, t, t, device=positions.device)


@dataclass(frozen=True)
class Documents:
    """One micro-batch's packed rows: each token's position in its document and the attention mask built from
    them once (a FlexAttention ``BlockMask`` on a GPU, a boolean ``[B, 1, T, T]`` elsewhere)."""
    positions: torch.Tensor  # int64 [B, T], on the device
    mask: Any

    @classmethod
    def of(cls, positions: torch.Tensor) -> "Documents":
        flex = flex_available(positions.device)
        return cls(positions, _block_mask(positions) if flex else block_diagonal(positions))

    @property
    def flex(self) -> bool:
        return not isinstance(self.mask, torch.Tensor)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Each query over the keys of its own document up to itself, fused; ``[B, H, T, D]`` with key/value
        heads possibly fewer than query heads."""
        gqa = k.shape[1] != q.shape[1]
        if self.flex:
            return _flex()(q, k, v, block_mask=self.mask, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=gqa)

    def boolean(self) -> torch.Tensor:
        """The boolean mask (the written-out attention of dropout reads it; a GPU builds it only then)."""
        return block_diagonal(self.positions) if self.flex else self.mask
