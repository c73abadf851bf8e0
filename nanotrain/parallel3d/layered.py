"""Tensor-parallel GPT-2 as a ``LayeredModel``: the pipeline cuts it into stages like the plain one.

Each layer is the tensor-parallel function of ``nanotrain.tensor_parallel.gpt2`` over this rank's
shard of the tree (``shard.shard_leaf``); the names, leaves and costs are ``gpt2_layered``'s, so
stages split at the same places for any tp. Between stages flow flat ``[tokens, C]`` activations,
or with sequence parallelism this rank's ``[tokens / tp, C]``: each TP rank of a stage sends its
own to the same TP rank of the next stage. The first stage looks tokens up in its vocabulary
slice of ``wte``; the last stage's head is the vocabulary-parallel loss over the same slice, so
the tied embedding's copies on the first and last stage are the same shard and the pipeline's
tied groups (one per pipeline, hence per TP rank) sum their gradients as they do without TP.

A layer sees only ``x``; it recovers ``(batch, seq)`` from the token count and ``seq_len``.
``recompute``: each block (or sub-layer) keeps only its input and runs again in backward, its
collectives included, which every rank of its TP group repeats in the same order.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Iterator

import torch
import torch.nn.functional as F

from nanotrain.models.gpt2 import GPT2Config
from nanotrain.memory.recompute import recompute as recomputed
from nanotrain.model import init_stream, param_spec
from nanotrain.pipeline.gpt2 import gpt2_layered
from nanotrain.pipeline.layered import Head, LayeredModel
from nanotrain.tensor_parallel.gpt2 import parallel_attention, parallel_block, parallel_embed, parallel_mlp
from nanotrain.tensor_parallel.layers import enter_parallel
from nanotrain.tensor_parallel.shard import TPPlan, shard_leaf
from nanotrain.tensor_parallel.vocab_parallel import vocab_parallel_cross_entropy
from nanotrain.tree import Tree

PARTS = {"block": parallel_block, "attn": parallel_attention, "mlp": parallel_mlp}


def _shape(x: torch.Tensor, plan: TPPlan, seq_len: int) -> tuple[int, int]:
    """(batch, seq) of the micro-batch whose (token shard of) activations ``x`` is."""
    tokens = x.shape[0] * (plan.grid.tp if plan.sequence_parallel else 1)
    return tokens // seq_len, seq_len


def _embed(params: Tree, tokens: torch.Tensor, plan: TPPlan) -> torch.Tensor:
    return parallel_embed(params, tokens, plan)


def _part(params: Tree, x: torch.Tensor, index: int, part: str, plan: TPPlan, seq_len: int,
          recompute: bool) -> torch.Tensor:
    p, fn, shape = params["blocks"][index], PARTS[part], _shape(x, plan, seq_len)
    keys = sorted(p)

    def run(x: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        y = fn(dict(zip(keys, ws)), x, shape, plan)
        return y if part == "block" else x + y  # a sub-layer returns its branch, without the residual

    return recomputed(run, x, *(p[k] for k in keys)) if recompute else run(x, *(p[k] for k in keys))


def _head(params: Tree, x: torch.Tensor, targets: torch.Tensor, denom: float, plan: TPPlan) -> torch.Tensor:
    cfg, group = plan.cfg, plan.grid.tp_group
    h = F.layer_norm(x, (x.shape[-1],), params["ln_f_w"], params["ln_f_b"], cfg.layer_norm_eps)
    h = enter_parallel(h, group, plan.sequence_parallel)
    return vocab_parallel_cross_entropy(h, params["wte"], targets.reshape(-1), plan.vocab.start, cfg.vocab_size,
                                        group, denom)


def _init(cfg: GPT2Config, plan: TPPlan, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The single-process model's initial values (``init_stream``), each cut to this rank's shard."""
    for path, t in init_stream(cfg, seed):
        yield path, shard_leaf(path, t, plan)


def tp_gpt2_layered(plan: TPPlan, seq_len: int, sublayers: bool = False, recompute: bool = False) -> LayeredModel:
    """This TP rank's GPT-2 as layers (see the module docstring); dropout must be off, as in any pipeline."""
    cfg = plan.cfg
    base = gpt2_layered(cfg, seq_len, sublayers)
    layers = []
    for layer in base.layers:
        index, _, part = layer.name.removeprefix("block").partition(".")
        apply = partial(_part, index=int(index), part=part or "block", plan=plan, seq_len=seq_len, recompute=recompute)
        layers.append(replace(layer, apply=apply))
    shapes = {path: tuple(shard_leaf(path, torch.empty(shape, device="meta"), plan).shape)
              for path, shape, _ in param_spec(cfg)}
    return replace(base, first=replace(base.first, apply=partial(_embed, plan=plan)), layers=tuple(layers),
                   head=Head(base.head.paths, partial(_head, plan=plan), base.head.cost), shapes=shapes,
                   init=partial(_init, cfg, plan))
