"""A tiny Llama-like ``ModelSpec`` written by hand against the ops, for checking that engines run a model
that is not GPT-2: RMSNorm (a weight, no bias), rotary positions (no position table), grouped-query
attention (2 key/value heads for 4 query heads), SwiGLU on a fused gate|up matrix 3x (not 4x) the
width, no biases, and an untied head (or a tied one). Unit names differ from GPT-2's on purpose, so an
engine that names a unit instead of asking the spec fails here."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from nanotrain.models.ops import PlainOps, make_generator, merge_heads, rms_norm, split_heads, swiglu
from nanotrain.models.spec import Costs, Dropout, Leaf, ModelSpec, Unit
from nanotrain.tree import Tree


@dataclass(frozen=True)
class LlamaLike:
    n_layer: int = 3
    width: int = 32
    heads: int = 4
    kv_heads: int = 2
    mlp: int = 96
    vocab_size: int = 512
    n_ctx: int = 64
    eps: float = 1e-5
    theta: float = 10000.0
    tied: bool = False
    dropout: float = 0.0  # on the embedding, the attention weights and each sublayer's output

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


BLOCK = ("attn_norm", "qkv", "out", "mlp_norm", "gate_up", "down")


def rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[B, H, T, D]`` at positions ``pos`` (the half-split layout)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angle = pos[:, None].float() * inv[None]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def embed(cfg: LlamaLike, params: Tree, tokens: torch.Tensor, ops: PlainOps, seed: int | None) -> torch.Tensor:
    x = ops.embed(tokens, params["embedding"])
    return ops.dropout(x, cfg.dropout, make_generator(seed, x.device))


def attention(cfg: LlamaLike, p: dict, x: torch.Tensor, ops: PlainOps, gen: torch.Generator | None) -> torch.Tensor:
    qkv = ops.norm_column(x, rms_norm(cfg.eps), (p["attn_norm"],), p["qkv"], None)
    heads, kv_heads = ops.heads(cfg.heads, cfg.kv_heads)
    q, k, v = split_heads(qkv, heads, kv_heads, cfg.head_dim)
    pos = ops.positions(x.shape[1], x.device)
    q, k = rotate(q, pos, cfg.theta), rotate(k, pos, cfg.theta)
    return ops.row(merge_heads(ops.attention(q, k, v, cfg.dropout, gen)), p["out"], None)


def mlp_in(cfg: LlamaLike, p: dict, h: torch.Tensor, ops: PlainOps) -> torch.Tensor:
    return ops.norm_column(h, rms_norm(cfg.eps), (p["mlp_norm"],), p["gate_up"], None)


def final_norm(cfg: LlamaLike, params: Tree, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(cfg.eps)(x, params["final_norm"])


def init_tensor(cfg: LlamaLike, leaf: Leaf, gen: torch.Generator) -> torch.Tensor:
    if leaf.init == "ones":
        return torch.ones(leaf.shape, device=gen.device)
    std = 0.02 if leaf.init == "normal" else 0.02 / math.sqrt(2 * cfg.n_layer)
    return torch.empty(leaf.shape, device=gen.device).normal_(0.0, std, generator=gen)


def llama_like(**overrides) -> ModelSpec:
    cfg = LlamaLike(**overrides)
    c, d, f, v = cfg.width, cfg.head_dim, cfg.mlp, cfg.vocab_size
    shapes = {"attn_norm": ((c,), "ones"), "qkv": (((cfg.heads + 2 * cfg.kv_heads) * d, c), "normal"),
              "out": ((c, cfg.heads * d), "residual"), "mlp_norm": ((c,), "ones"),
              "gate_up": ((2 * f, c), "normal"), "down": ((c, f), "residual")}
    blocks = [Unit(f"blocks.{i}", tuple(f"blocks.{i}.{k}" for k in BLOCK), "block", i) for i in range(cfg.n_layer)]
    head_paths = ("final_norm",) if cfg.tied else ("final_norm", "lm_head")
    leaves = [Leaf("embedding", (v, c), "normal")]
    leaves += [Leaf(path, *shapes[path.rsplit(".", 1)[1]]) for unit in blocks for path in unit.paths]
    leaves += [Leaf("final_norm", (c,), "ones")] + ([] if cfg.tied else [Leaf("lm_head", (v, c), "normal")])
    block_params = sum(math.prod(s) for s, _ in shapes.values())
    costs = Costs(n_layer=cfg.n_layer, width=c, vocab=v, embed_params=v * c, block_params=block_params,
                  head_params=c + (0 if cfg.tied else v * c), lookup_params=0 if cfg.tied else v * c,
                  block_replicated=2 * c, last_matmul=c * f, attention_width=cfg.heads * d,
                  act_bytes=(("none", 0), ("lean", 0), ("selective", 0), ("every", 2 * c)), recompute_bytes=0)
    return ModelSpec(
        family="llama-like", cfg=cfg, leaves=tuple(leaves),
        units=(Unit("tokens", ("embedding",), "embed"), *blocks, Unit("final", head_paths, "head")),
        tied=("embedding",) if cfg.tied else (), fp32_moments=("embedding",), attn_keys=BLOCK[:3],
        mlp_keys=BLOCK[3:], mlp_out=("down", None), heads=(cfg.heads, cfg.kv_heads, d), mlp_width=f,
        n_ctx=cfg.n_ctx, vocab_size=v, dropout=Dropout(cfg.dropout, cfg.dropout, cfg.dropout), costs=costs,
        embed=partial(embed, cfg), attention=partial(attention, cfg), mlp_in=partial(mlp_in, cfg), act=swiglu,
        final_norm=partial(final_norm, cfg), head_weight="embedding" if cfg.tied else "lm_head",
        init_tensor=partial(init_tensor, cfg))
