"""The functional GPT-2 as a ``LayeredModel``: embedding, one layer per block, final norm + tied head."""
from __future__ import annotations

from functools import partial

import torch

from nanotrain.models.gpt2 import GPT2Config
from nanotrain.loss import IGNORE_INDEX
from nanotrain.model import (BLOCK_SPEC, attention, block, embed, empty_tree, final_norm, head_loss, init_stream, mlp,
                             param_spec)
from nanotrain.pipeline.layered import Head, Layer, LayeredModel
from nanotrain.tree import Tree


def _embed(params: Tree, tokens: torch.Tensor, cfg: GPT2Config) -> torch.Tensor:
    return embed(params, tokens, cfg)


def _block(params: Tree, x: torch.Tensor, index: int, cfg: GPT2Config) -> torch.Tensor:
    return block(params["blocks"][index], x, cfg)


def _attention(params: Tree, x: torch.Tensor, index: int, cfg: GPT2Config) -> torch.Tensor:
    return x + attention(params["blocks"][index], x, cfg)


def _mlp(params: Tree, x: torch.Tensor, index: int, cfg: GPT2Config) -> torch.Tensor:
    return x + mlp(params["blocks"][index], x, cfg)


def _head(params: Tree, x: torch.Tensor, targets: torch.Tensor, denom: float, cfg: GPT2Config) -> torch.Tensor:
    # Gradients in backward: the last stage then runs one forward to two backwards like the others.
    return head_loss(params, final_norm(params, x, cfg), targets, denom, keep_logits=True)


def _denominator(targets: torch.Tensor) -> float:
    return float(max(int((targets != IGNORE_INDEX).sum()), 1))


def gpt2_layered(cfg: GPT2Config, seq_len: int | None = None, sublayers: bool = False) -> LayeredModel:
    """GPT-2 without dropout, costed in forward FLOPs per token at ``seq_len`` (default: the context).

    ``sublayers``: each block is two layers, its attention and its MLP (a third and two thirds of
    its FLOPs), so stages can be balanced twice as finely: with whole blocks, gpt2-xl's 48 blocks,
    embedding and head split 4 ways leave one stage about 3% above the mean, the pipeline's pace.

    Dropout masks are drawn per call, so a micro-batch could not reproduce the full batch's masks;
    the pipeline refuses a config with dropout rather than train something subtly different.
    """
    if cfg.has_dropout:
        raise ValueError("pipeline training of GPT-2 needs dropout off (embd_pdrop = attn_pdrop = resid_pdrop = 0): "
                         "a micro-batch cannot replay the single-process dropout masks")
    c, t = cfg.n_embd, seq_len or cfg.n_ctx
    names = [name for name, _, _ in BLOCK_SPEC]
    if sublayers:  # the first six leaves are ln_1, qkv and proj; the last six ln_2, fc and fc_proj
        layers = tuple(layer for i in range(cfg.n_layer) for layer in (
            Layer(f"block{i}.attn", tuple(f"blocks.{i}.{n}" for n in names[:6]), partial(_attention, index=i, cfg=cfg),
                  cost=8 * c * c + 4 * t * c),
            Layer(f"block{i}.mlp", tuple(f"blocks.{i}.{n}" for n in names[6:]), partial(_mlp, index=i, cfg=cfg),
                  cost=16 * c * c)))
    else:
        layers = tuple(Layer(f"block{i}", tuple(f"blocks.{i}.{n}" for n in names), partial(_block, index=i, cfg=cfg),
                             cost=24 * c * c + 4 * t * c) for i in range(cfg.n_layer))
    return LayeredModel(
        first=Layer("embed", ("wte", "wpe"), partial(_embed, cfg=cfg), cost=0.0),
        layers=layers,
        head=Head(("ln_f_w", "ln_f_b", "wte"), partial(_head, cfg=cfg), cost=2 * cfg.vocab_size * c),
        shapes={path: shape for path, shape, _ in param_spec(cfg)},
        init=partial(init_stream, cfg),
        skeleton=partial(empty_tree, cfg),
        denominator=_denominator,
    )
