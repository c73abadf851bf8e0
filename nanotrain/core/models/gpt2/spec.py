"""GPT-2 as a ``ModelSpec``: its leaves (shapes, init, tensor-parallel placement), units and activation bytes."""
from __future__ import annotations

import math
from functools import cache, partial

from nanotrain.core.models.gpt2 import model
from nanotrain.core.models.gpt2.config import GPT2Config
from nanotrain.core.models.ops import gelu_tanh
from nanotrain.core.models.spec import (NEURONS, Q_HEADS, REPLICATED, VOCAB, BlockLeaf, Dropout, Leaf, ModelSpec,
                                   Placement, stack)


def block_leaves(cfg: GPT2Config) -> tuple[list[BlockLeaf], list[BlockLeaf]]:
    """The attention's leaves and the MLP's. Init kinds: "normal" N(0, 0.02), "residual" N(0, 0.02 / sqrt(2
    n_layer)) for the projections into the residual stream, "zeros", "ones"."""
    c, d = cfg.n_embd, cfg.head_dim
    qkv = Placement(0, ((Q_HEADS, d),) * 3)  # rows: q of every head, then k, then v
    attn = [("ln_1_w", (c,), "ones", REPLICATED), ("ln_1_b", (c,), "zeros", REPLICATED),
            ("qkv_w", (3 * c, c), "normal", qkv), ("qkv_b", (3 * c,), "zeros", qkv),
            ("proj_w", (c, c), "residual", Placement(1, ((Q_HEADS, d),))), ("proj_b", (c,), "zeros", REPLICATED)]
    mlp = [("ln_2_w", (c,), "ones", REPLICATED), ("ln_2_b", (c,), "zeros", REPLICATED),
           ("fc_w", (4 * c, c), "normal", Placement(0, ((NEURONS, 1),))),
           ("fc_b", (4 * c,), "zeros", Placement(0, ((NEURONS, 1),))),
           ("fc_proj_w", (c, 4 * c), "residual", Placement(1, ((NEURONS, 1),))),
           ("fc_proj_b", (c,), "zeros", REPLICATED)]
    return attn, mlp


@cache
def gpt2_spec(cfg: GPT2Config) -> ModelSpec:
    c = cfg.n_embd
    embed = [Leaf("wte", (cfg.vocab_size, c), "normal", Placement(0, ((VOCAB, 1),))),
             Leaf("wpe", (cfg.n_ctx, c), "normal")]
    head = [Leaf("ln_f_w", (c,), "ones"), Leaf("ln_f_b", (c,), "zeros")]
    layout = stack(embed, *block_leaves(cfg), cfg.n_layer, head, "ln_f")
    # Saved activations per token per block in bf16 (Korthikanti et al. 2022 count 34 C with fused
    # attention): lean keeps the norms' and the GELU's inputs instead of their outputs (22 C), selective
    # recomputes the MLP (18 C), every keeps the input alone (2 C). Compiled (inductor's partitioner, the
    # resident and data-parallel trainers' blocks without recompute): each LayerNorm's input and output (4 C) and
    # its fp32 mean and reciprocal deviation (8 bytes on a GPU; a CPU keeps them in bf16), q|k|v (6 C), the
    # attention output (2 C) and its fp32 log-sum-exp (4 H), the fc output and its GELU (16 C): 32 C + 4 H + 16
    # (``tests/core/test_activation_bytes.py`` counts a compiled block's saved tensors against it).
    act = (("none", 34 * c), ("lean", 22 * c), ("selective", 18 * c), ("every", 2 * c),
           ("compiled", 32 * c + 4 * cfg.n_head + 16))
    return ModelSpec(
        family="gpt2", cfg=cfg, **layout, fp32_moments=("wte", "wpe"), mlp_out=("fc_proj_w", "fc_proj_b"),
        heads=(cfg.n_head, cfg.n_head, cfg.head_dim), mlp_width=4 * c, n_ctx=cfg.n_ctx, vocab_size=cfg.vocab_size,
        width=c, act_bytes=act, dropout=Dropout(cfg.embd_pdrop, cfg.attn_pdrop, cfg.resid_pdrop),
        embed=partial(model.embed, cfg), attention=partial(model.attention, cfg), mlp_in=partial(model.mlp_in, cfg),
        act=gelu_tanh, final_norm=partial(model.final_norm, cfg), head_weight="wte",
        init_std={"normal": 0.02, "residual": 0.02 / math.sqrt(2 * cfg.n_layer)},
        # as PEFT can adapt GPT-2's Conv1D matrices: the fused q|k|v whole (c_attn), and the three others
        lora_targets=(("qkv", "qkv_w", None), ("o", "proj_w", None), ("up", "fc_w", None), ("down", "fc_proj_w", None)))
