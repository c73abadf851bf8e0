"""The Llama-class pieces, written once against the ops (``models.ops``): every engine runs these.

The tree is ``{"wte", "blocks": [block, ...], "norm_w"}`` plus ``"lm_head_w"`` when the head is untied; linear
weights are ``[out, in]``, q|k|v and gate|up are each one fused matrix. A block (``models.run.block``):
``h = x + o(attention(rope(q), rope(k), v))`` over ``rms_norm(x)``, ``y = h + down(silu(gate) * up)`` over
``rms_norm(h)``. No biases but Qwen2's on q, k, v; Qwen3 normalises each q and k head before the rotation.
"""
from __future__ import annotations

import math

import torch

from nanotrain.core.models.llama.config import LlamaConfig
from nanotrain.core.models.ops import PlainOps, merge_heads, rms_norm, split_heads
from nanotrain.core.tree import Tree
def inverse_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """The rotary inverse frequencies ``[head_dim / 2]`` in fp32 on the CPU, scaled as ``cfg.rope_scaling`` says.

    Computed once per config (the spec holds them) with the operations ``transformers`` uses, so the tables
    agree with its rotary module to the bit.
    """
    d = cfg.heads[2]
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s.kind == "linear":
        return inv / s.factor
    # llama3: long wavelengths (low frequencies) slowed down by ``factor``, short ones kept, a blend between
    old = s.original_max_position_embeddings
    long, short = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    slowed = torch.where(wavelen > long, inv / s.factor, inv)
    blend = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - blend) * slowed / s.factor + blend * slowed
    return torch.where((wavelen >= short) & (wavelen <= long), blended, slowed)


def rotary_tables(inv_freq: torch.Tensor, positions: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[..., T, head_dim]`` at ``positions`` (``[T]``, or ``[B, T]`` for packed rows): angles in fp32,
    then cast to the activations' dtype.

    The inverse frequencies come from the host without a device sync (``non_blocking``); no tensor is cached
    per device, so a compiled block keeps one graph.
    """
    angles = positions.float()[..., None] * inv_freq.to(positions.device, non_blocking=True)
    angles = torch.cat((angles, angles), dim=-1)  # the two halves of a head turn as pairs (i, i + d/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``[B, H, T, D]`` (``transformers``' "rotate half" convention, not interleaved pairs) by
    tables ``[T, D]`` or, packed, ``[B, T, D]`` (one per row, the same for every head)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def embed(params: Tree, tokens: torch.Tensor, ops: PlainOps, seed: int | None) -> torch.Tensor:
    """Token embeddings only: positions enter attention as rotations. No embedding dropout in this family."""
    return ops.embed(tokens, params["wte"])


def attention(cfg: LlamaConfig, inv_freq: torch.Tensor, p: dict, x: torch.Tensor, ops: PlainOps,
              gen: torch.Generator | None) -> torch.Tensor:
    """RMSNorm -> fused q|k|v -> (Qwen3: per-head q/k RMSNorm) -> rotary -> causal attention -> o."""
    norm = rms_norm(cfg.rms_norm_eps)
    qkv = ops.norm_column(x, norm, (p["attn_norm_w"],), p["qkv_w"], p["qkv_b"] if cfg.attention_bias else None)
    n_head, n_kv, d = cfg.heads
    heads, kv_heads = ops.heads(n_head, n_kv)
    q, k, v = split_heads(qkv, heads, kv_heads, d)
    if cfg.qk_norm:
        q, k = norm(q, p["q_norm_w"]), norm(k, p["k_norm_w"])
    cos, sin = rotary_tables(inv_freq, ops.positions(q.shape[-2], q.device), q.dtype)
    y = ops.attention(rotate(q, cos, sin), rotate(k, cos, sin), v, cfg.attention_dropout, gen)
    return ops.row(merge_heads(y), p["o_w"], None)


def mlp_in(cfg: LlamaConfig, p: dict, h: torch.Tensor, ops: PlainOps) -> torch.Tensor:
    """RMSNorm -> the fused gate|up projection (``swiglu`` and the down projection follow: ``models.run``)."""
    return ops.norm_column(h, rms_norm(cfg.rms_norm_eps), (p["mlp_norm_w"],), p["gate_up_w"], None)


def final_norm(cfg: LlamaConfig, params: Tree, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(cfg.rms_norm_eps)(x, params["norm_w"])
