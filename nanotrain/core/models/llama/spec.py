"""The Llama-class family as a ``ModelSpec``: its leaves (shapes, init, tensor-parallel placement), units and
activation bytes."""
from __future__ import annotations

from functools import cache, partial

from nanotrain.core.models.llama import model
from nanotrain.core.models.llama.config import LlamaConfig
from nanotrain.core.models.ops import swiglu
from nanotrain.core.models.spec import (IN_REGION, KV_HEADS, NEURONS, Q_HEADS, REPLICATED, VOCAB, BlockLeaf, Dropout, Leaf,
                                   ModelSpec, Placement, stack)

ROWS_BY_VOCAB = Placement(0, ((VOCAB, 1),))


def block_leaves(cfg: LlamaConfig) -> tuple[list[BlockLeaf], list[BlockLeaf]]:
    """The attention's leaves and the MLP's, in checkpoint order. Init as ``transformers``' ``_init_weights``:
    "normal" N(0, initializer_range) for every matrix, "ones" for norms, "zeros" for biases."""
    c, i = cfg.n_embd, cfg.intermediate_size
    h, kv, d = cfg.heads
    qkv = Placement(0, ((Q_HEADS, d), (KV_HEADS, d), (KV_HEADS, d)))  # rows: q of every head, then k, then v
    attn = [("attn_norm_w", (c,), "ones", REPLICATED), ("qkv_w", ((h + 2 * kv) * d, c), "normal", qkv)]
    if cfg.attention_bias:
        attn.append(("qkv_b", ((h + 2 * kv) * d,), "zeros", qkv))
    if cfg.qk_norm:
        attn += [("q_norm_w", (d,), "ones", IN_REGION), ("k_norm_w", (d,), "ones", IN_REGION)]
    attn.append(("o_w", (c, h * d), "normal", Placement(1, ((Q_HEADS, d),))))
    mlp = [("mlp_norm_w", (c,), "ones", REPLICATED),
           ("gate_up_w", (2 * i, c), "normal", Placement(0, ((NEURONS, 1), (NEURONS, 1)))),  # gate rows, then up rows
           ("down_w", (c, i), "normal", Placement(1, ((NEURONS, 1),)))]
    return attn, mlp


def activation_bytes(cfg: LlamaConfig) -> tuple[tuple[str, int], ...]:
    """Bytes per token per block that autograd keeps in bf16 with fused attention and no dropout, by policy.

    Counted from the ops (elements x 2 bytes unless fp32): each RMSNorm widens its input to fp32 and keeps
    that (4 C), its fp32 reciprocal root (4), its bf16 output before and after the weight's scaling (2 C + 2 C);
    q|k|v out of the matmul stays whole (v is a view of it: 2 (H + 2 KV) D); the rotated q and k (2 (H + KV) D);
    the attention output, also the o matmul's input (2 H D), its fp32 log-sum-exp (4 H); the cos and sin tables
    (4 D per position, shared by the rows: counted as at one row); gate|up (4 I), silu(gate) (2 I) and the
    product, the down matmul's input (2 I). Qwen3's q/k norms keep their fp32 input, reciprocal root and bf16
    output before the scaling (6 (H + KV) D + 4 (H + KV)): the scaled heads are the rotation's input, which
    keeps only the tables. ``lean`` keeps each norm's bf16 input instead (2 C, not 8 C + 4) and gate|up alone
    for the activation and down matmul (4 I, not 8 I); ``selective`` keeps the attention's and the MLP's
    input (2 C); ``every`` the block input (2 C).

    ``compiled``: what inductor's partitioner (``torch.compile``'s default, which the resident and data-parallel
    trainers give a block they do not recompute) saves instead of ``none``. It keeps each norm's bf16 input and
    output and its fp32 reciprocal root (2 C + 2 C + 4: the fp32 copy is recomputed from the input), q|k|v whole,
    the rotated q and k, the attention output and its log-sum-exp (not the o matmul's input, a copy of that
    output made again in backward, nor the cos and sin tables), Qwen3's per-head reciprocal roots (4 (H + KV), not
    the normalised heads), gate|up and the product (4 I + 2 I; silu(gate) is recomputed).
    ``tests/core/test_activation_bytes.py`` counts what a compiled block saves against this.
    """
    c, i = cfg.n_embd, cfg.intermediate_size
    h, kv, d = cfg.heads
    qkv, rotated, out = 2 * (h + 2 * kv) * d, 2 * (h + kv) * d, 2 * h * d + 4 * h
    roots = 4 * (h + kv) if cfg.qk_norm else 0  # Qwen3's per-head reciprocal roots, kept eager and compiled
    attention = qkv + rotated + out + 4 * d + roots + (6 * (h + kv) * d if cfg.qk_norm else 0)
    norm = 8 * c + 4  # eager: fp32 input, reciprocal root, bf16 output unscaled and scaled
    return (("none", norm + attention + norm + 8 * i), ("lean", 2 * c + attention + 2 * c + 4 * i),
            ("selective", norm + attention + 2 * c), ("every", 2 * c),
            ("compiled", 2 * (4 * c + 4) + qkv + rotated + out + roots + 6 * i))


@cache
def llama_spec(cfg: LlamaConfig) -> ModelSpec:
    c, v = cfg.n_embd, cfg.vocab_size
    head = [Leaf("norm_w", (c,), "ones")]
    if not cfg.tie_word_embeddings:  # the head owns an output matrix only when untied
        head.append(Leaf("lm_head_w", (v, c), "normal", ROWS_BY_VOCAB))
    layout = stack([Leaf("wte", (v, c), "normal", ROWS_BY_VOCAB)], *block_leaves(cfg), cfg.n_layer, head, "head")
    return ModelSpec(
        family="llama", cfg=cfg, **layout,
        # rare tokens' rows get gradients too small for 8-bit moments
        fp32_moments=("wte",) if cfg.tie_word_embeddings else ("wte", "lm_head_w"),
        mlp_out=("down_w", None), heads=cfg.heads,
        # Within the sliding window, windowed attention is causal attention; past it we would compute something
        # else, so longer sequences are refused there.
        mlp_width=cfg.intermediate_size, n_ctx=min(cfg.n_ctx, cfg.sliding_window or cfg.n_ctx), vocab_size=v,
        width=c, act_bytes=activation_bytes(cfg),
        dropout=Dropout(attention=cfg.attention_dropout),
        embed=model.embed, attention=partial(model.attention, cfg, model.inverse_frequencies(cfg)),
        mlp_in=partial(model.mlp_in, cfg), act=swiglu, final_norm=partial(model.final_norm, cfg),
        head_weight="wte" if cfg.tie_word_embeddings else "lm_head_w", init_std={"normal": cfg.initializer_range},
        window=cfg.sliding_window,
        # PEFT's names less "_proj": q, k, v are the segments of the fused q|k|v, gate and up those of gate|up
        lora_targets=(("q", "qkv_w", 0), ("k", "qkv_w", 1), ("v", "qkv_w", 2), ("o", "o_w", None),
                      ("gate", "gate_up_w", 0), ("up", "gate_up_w", 1), ("down", "down_w", None)))
