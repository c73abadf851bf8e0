"""The functional GPT-2 as a ``LayeredModel``: embedding, one layer per block, final norm + tied head."""
from __future__ import annotations

from functools import partial

import torch

from nanotrain.config import GPT2Config
from nanotrain.loss import IGNORE_INDEX
from nanotrain.model import BLOCK_SPEC, block, embed, empty_tree, final_norm, head_loss, init_stream, param_spec
from nanotrain.pipeline.layered import Head, Layer, LayeredModel
from nanotrain.tree import Tree


def _embed(params: Tree, tokens: torch.Tensor, cfg: GPT2Config) -> torch.Tensor:
    return embed(params, tokens, cfg)


def _block(params: Tree, x: torch.Tensor, index: int, cfg: GPT2Config) -> torch.Tensor:
    return block(params["blocks"][index], x, cfg)


def _head(params: Tree, x: torch.Tensor, targets: torch.Tensor, denom: float, cfg: GPT2Config) -> torch.Tensor:
    # Gradients in backward: the last stage then runs one forward to two backwards like the others.
    return head_loss(params, final_norm(params, x, cfg), targets, denom, keep_logits=True)


def _denominator(targets: torch.Tensor) -> float:
    return float(max(int((targets != IGNORE_INDEX).sum()), 1))


def gpt2_layered(cfg: GPT2Config, seq_len: int | None = None) -> LayeredModel:
    """GPT-2 without dropout, costed in forward FLOPs per token at ``seq_len`` (default: the context).

    Dropout masks are drawn per call, so a micro-batch could not reproduce the full batch's masks;
    the pipeline refuses a config with dropout rather than train something subtly different.
    """
    if cfg.has_dropout:
        raise ValueError("pipeline training of GPT-2 needs dropout off (embd_pdrop = attn_pdrop = resid_pdrop = 0): "
                         "a micro-batch cannot replay the single-process dropout masks")
    c, t = cfg.n_embd, seq_len or cfg.n_ctx
    block_paths = [tuple(f"blocks.{i}.{name}" for name, _, _ in BLOCK_SPEC) for i in range(cfg.n_layer)]
    return LayeredModel(
        first=Layer("embed", ("wte", "wpe"), partial(_embed, cfg=cfg), cost=0.0),
        layers=tuple(Layer(f"block{i}", block_paths[i], partial(_block, index=i, cfg=cfg), cost=24 * c * c + 4 * t * c)
                     for i in range(cfg.n_layer)),
        head=Head(("ln_f_w", "ln_f_b", "wte"), partial(_head, cfg=cfg), cost=2 * cfg.vocab_size * c),
        shapes={path: shape for path, shape, _ in param_spec(cfg)},
        init=partial(init_stream, cfg),
        skeleton=partial(empty_tree, cfg),
        denominator=_denominator,
    )
