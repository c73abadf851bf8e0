"""GPT-2 as a ``ModelSpec``: its leaves (shapes, init, tensor-parallel placement), units and costs."""
from __future__ import annotations

import math
from functools import cache, partial

import torch

from nanotrain.models.gpt2 import model
from nanotrain.models.gpt2.config import GPT2Config
from nanotrain.models.ops import gelu_tanh
from nanotrain.models.spec import (NEURONS, Q_HEADS, REPLICATED, VOCAB, Costs, Dropout, Leaf, ModelSpec, Placement,
                                   Unit, init_leaf)

EMBED, HEAD = ("wte", "wpe"), ("ln_f_w", "ln_f_b")
ATTN_KEYS = ("ln_1_w", "ln_1_b", "qkv_w", "qkv_b", "proj_w", "proj_b")
MLP_KEYS = ("ln_2_w", "ln_2_b", "fc_w", "fc_b", "fc_proj_w", "fc_proj_b")


def block_leaves(cfg: GPT2Config) -> list[tuple[str, tuple[int, ...], str, Placement]]:
    """(name, shape, init, placement) of a block's leaves. Init kinds: "normal" N(0, 0.02), "residual"
    N(0, 0.02 / sqrt(2 n_layer)) for the projections into the residual stream, "zeros", "ones"."""
    c, d = cfg.n_embd, cfg.head_dim
    qkv = Placement(0, ((Q_HEADS, d),) * 3)  # rows: q of every head, then k, then v
    return [
        ("ln_1_w", (c,), "ones", REPLICATED), ("ln_1_b", (c,), "zeros", REPLICATED),
        ("qkv_w", (3 * c, c), "normal", qkv), ("qkv_b", (3 * c,), "zeros", qkv),
        ("proj_w", (c, c), "residual", Placement(1, ((Q_HEADS, d),))), ("proj_b", (c,), "zeros", REPLICATED),
        ("ln_2_w", (c,), "ones", REPLICATED), ("ln_2_b", (c,), "zeros", REPLICATED),
        ("fc_w", (4 * c, c), "normal", Placement(0, ((NEURONS, 1),))),
        ("fc_b", (4 * c,), "zeros", Placement(0, ((NEURONS, 1),))),
        ("fc_proj_w", (c, 4 * c), "residual", Placement(1, ((NEURONS, 1),))), ("fc_proj_b", (c,), "zeros", REPLICATED),
    ]


def leaves(cfg: GPT2Config) -> list[Leaf]:
    c = cfg.n_embd
    out = [Leaf("wte", (cfg.vocab_size, c), "normal", Placement(0, ((VOCAB, 1),))),
           Leaf("wpe", (cfg.n_ctx, c), "normal")]
    out += [Leaf(f"blocks.{i}.{name}", shape, init, placement)
            for i in range(cfg.n_layer) for name, shape, init, placement in block_leaves(cfg)]
    return out + [Leaf("ln_f_w", (c,), "ones"), Leaf("ln_f_b", (c,), "zeros")]


def init_tensor(cfg: GPT2Config, leaf: Leaf, gen: torch.Generator) -> torch.Tensor:
    """GPT-2's init (``block_leaves`` says which std a leaf takes)."""
    return init_leaf(leaf, gen, 0.02 if leaf.init == "normal" else 0.02 / math.sqrt(2 * cfg.n_layer))


def costs(cfg: GPT2Config) -> Costs:
    c, v = cfg.n_embd, cfg.vocab_size
    # Saved activations per token per block in bf16 (Korthikanti et al. 2022 count 34 C with fused
    # attention): lean keeps the norms' and the GELU's inputs instead of their outputs (22 C), selective
    # recomputes the MLP (18 C), every keeps the input alone (2 C).
    act = (("none", 34 * c), ("lean", 22 * c), ("selective", 18 * c), ("every", 2 * c))
    return Costs(n_layer=cfg.n_layer, width=c, vocab=v, embed_params=(v + cfg.n_ctx) * c,
                 block_params=12 * c * c + 13 * c, head_params=2 * c, lookup_params=cfg.n_ctx * c,
                 last_matmul=4 * c * c + c, attention_width=c, act_bytes=act, recompute_bytes=34 * c)


@cache
def gpt2_spec(cfg: GPT2Config) -> ModelSpec:
    blocks = tuple(Unit(f"blocks.{i}", tuple(f"blocks.{i}.{name}" for name, *_ in block_leaves(cfg)), "block", i)
                   for i in range(cfg.n_layer))
    return ModelSpec(
        family="gpt2", cfg=cfg, leaves=tuple(leaves(cfg)),
        units=(Unit("embed", EMBED, "embed"), *blocks, Unit("ln_f", HEAD, "head")),
        tied=("wte",), fp32_moments=EMBED, attn_keys=ATTN_KEYS, mlp_keys=MLP_KEYS, mlp_out=("fc_proj_w", "fc_proj_b"),
        heads=(cfg.n_head, cfg.n_head, cfg.head_dim), mlp_width=4 * cfg.n_embd, n_ctx=cfg.n_ctx,
        vocab_size=cfg.vocab_size, dropout=Dropout(cfg.embd_pdrop, cfg.attn_pdrop, cfg.resid_pdrop), costs=costs(cfg),
        embed=partial(model.embed, cfg), attention=partial(model.attention, cfg), mlp_in=partial(model.mlp_in, cfg),
        act=gelu_tanh, final_norm=partial(model.final_norm, cfg), head_weight="wte",
        init_tensor=partial(init_tensor, cfg))
