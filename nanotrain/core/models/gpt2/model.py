"""GPT-2's pieces, written once against the ops (``models.ops``): every engine runs these.

The tree is ``{"wte", "wpe", "blocks": [block, ...], "ln_f_w", "ln_f_b"}``, each block a flat dict of
twelve tensors; linear weights are ``[out, in]``; the LM head is the token embedding itself.
A block (``models.run.block``): ``h = x + attention(ln_1(x))``, ``y = h + fc_proj(gelu(fc(ln_2(h))))``.
"""
from __future__ import annotations

import torch

from nanotrain.core.models.gpt2.config import GPT2Config
from nanotrain.core.models.ops import PlainOps, layer_norm, make_generator, merge_heads, split_heads
from nanotrain.core.tree import Tree
def embed(cfg: GPT2Config, params: Tree, tokens: torch.Tensor, ops: PlainOps, seed: int | None) -> torch.Tensor:
    """Token + position embeddings; ``seed`` turns dropout on (training) and fixes its mask."""
    x = ops.embed(tokens, params["wte"], params["wpe"])
    return ops.dropout(x, cfg.embd_pdrop, make_generator(seed, x.device))


def attention(cfg: GPT2Config, p: dict, x: torch.Tensor, ops: PlainOps, gen: torch.Generator | None) -> torch.Tensor:
    """ln_1 -> fused q/k/v -> causal attention -> output projection."""
    qkv = ops.norm_column(x, layer_norm(cfg.layer_norm_eps), (p["ln_1_w"], p["ln_1_b"]), p["qkv_w"], p["qkv_b"])
    heads, _ = ops.heads(cfg.n_head, cfg.n_head)
    q, k, v = split_heads(qkv, heads, heads, cfg.head_dim)
    return ops.row(merge_heads(ops.attention(q, k, v, cfg.attn_pdrop, gen)), p["proj_w"], p["proj_b"])


def mlp_in(cfg: GPT2Config, p: dict, h: torch.Tensor, ops: PlainOps) -> torch.Tensor:
    """ln_2 -> the up projection (tanh GELU and the down projection follow: ``models.run``)."""
    return ops.norm_column(h, layer_norm(cfg.layer_norm_eps), (p["ln_2_w"], p["ln_2_b"]), p["fc_w"], p["fc_b"])


def final_norm(cfg: GPT2Config, params: Tree, x: torch.Tensor) -> torch.Tensor:
    return layer_norm(cfg.layer_norm_eps)(x, params["ln_f_w"], params["ln_f_b"])
