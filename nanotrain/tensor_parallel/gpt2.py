"""GPT-2's forward on a tensor-parallel shard of its tree (``shard.shard_params``).

Attention splits heads, the MLP splits neurons (each one all-reduce in forward and one in
backward), the token embedding and the tied head split the vocabulary. Activations between
those regions are flat ``[tokens, C]``: all ``B*T`` tokens on every rank, or with sequence
parallelism (Korthikanti et al. 2022) this rank's contiguous ``B*T/tp`` tokens, on which the
LayerNorms, residual adds, biases and dropout run. LayerNorm, dropout and bias are per token, so
any split of the tokens works; a contiguous one makes all-gather and reduce-scatter copy-free.

Dropout is exact against the single-process model with the same seed: each rank draws the mask
of the *whole* tensor from the generator ``nanotrain.model`` would use (same seeds, through
``make_generator`` and ``sublayer_seeds``), in the same order, and keeps its slice: its heads of
the attention mask, its tokens of a residual mask. That costs tp times the random numbers of a
shard, and nothing else.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from nanotrain.model import (Block, causal_attention, make_generator, merge_heads, split_heads, sublayer_seeds,
                             validate_tokens)
from nanotrain.tensor_parallel.comms import all_gather_split
from nanotrain.tensor_parallel.compiled import compiled_block
from nanotrain.tensor_parallel.layers import column_linear, enter_parallel, leave_parallel, row_linear
from nanotrain.tensor_parallel.shard import TPPlan, token_range
from nanotrain.tensor_parallel.vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_lookup
from nanotrain.tree import Tree


def _sliced_dropout(x: torch.Tensor, p: float, gen: torch.Generator | None, full_shape: tuple[int, ...],
                    take: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Dropout on a shard with ``take`` of the mask the single-process model draws for the whole tensor."""
    if gen is None or p == 0.0:
        return x
    keep = torch.rand(full_shape, generator=gen, device=x.device, dtype=torch.float32) >= p
    return x * take(keep).to(x.dtype) / (1.0 - p)


def _residual_dropout(x: torch.Tensor, p: float, gen: torch.Generator | None, shape: tuple[int, int],
                      plan: TPPlan) -> torch.Tensor:
    b, t = shape
    tokens = token_range(b * t, plan)
    return _sliced_dropout(x, p, gen, (b, t, x.shape[-1]),
                           lambda m: m.view(b * t, -1)[tokens.start:tokens.stop])


def _attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TPPlan,
                    gen: torch.Generator | None) -> torch.Tensor:
    p = plan.cfg.attn_pdrop
    if gen is None or p == 0.0:
        return causal_attention(q, k, v, 0.0, None)
    # Written out as in nanotrain.model so the mask is this rank's heads of the full [B, H, T, T] mask.
    b, _, t, _ = q.shape
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    att = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    heads = plan.heads
    att = _sliced_dropout(att, p, gen, (b, plan.cfg.n_head, t, t), lambda m: m[:, heads.start:heads.stop])
    return att @ v


def parallel_embed(local: Tree, tokens: torch.Tensor, plan: TPPlan, seed: int | None = None) -> torch.Tensor:
    """Token + position embeddings as flat ``[tokens, C]`` (this rank's tokens with sequence parallelism)."""
    b, t = tokens.shape
    mine = token_range(b * t, plan)
    partial = vocab_parallel_lookup(tokens.reshape(-1), local["wte"], plan.vocab.start)
    x = leave_parallel(partial, plan.grid.tp_group, plan.sequence_parallel)
    pos = torch.arange(mine.start, mine.stop, device=tokens.device) % t
    x = x + F.embedding(pos, local["wpe"])
    return _residual_dropout(x, plan.cfg.embd_pdrop, make_generator(seed, x.device), (b, t), plan)


def parallel_attention(p: Block, x: torch.Tensor, shape: tuple[int, int], plan: TPPlan,
                       gen: torch.Generator | None = None) -> torch.Tensor:
    """ln_1 -> this rank's heads of qkv -> causal attention -> row-parallel projection."""
    cfg, group, sp, ov = plan.cfg, plan.grid.tp_group, plan.sequence_parallel, plan.overlap
    b, t = shape
    h = F.layer_norm(x, (x.shape[-1],), p["ln_1_w"], p["ln_1_b"], cfg.layer_norm_eps)
    q, k, v = split_heads(column_linear(h, p["qkv_w"], p["qkv_b"], group, sp, ov).view(b, t, -1), cfg)
    y = merge_heads(_attention_core(q, k, v, plan, gen)).view(b * t, -1)
    return _residual_dropout(row_linear(y, p["proj_w"], p["proj_b"], group, sp, ov), cfg.resid_pdrop, gen, shape,
                             plan)


def parallel_mlp(p: Block, x: torch.Tensor, shape: tuple[int, int], plan: TPPlan,
                 gen: torch.Generator | None = None) -> torch.Tensor:
    """ln_2 -> column-parallel fc -> GELU -> row-parallel projection: one all-reduce in forward."""
    cfg, group, sp, ov = plan.cfg, plan.grid.tp_group, plan.sequence_parallel, plan.overlap
    h = F.layer_norm(x, (x.shape[-1],), p["ln_2_w"], p["ln_2_b"], cfg.layer_norm_eps)
    h = F.gelu(column_linear(h, p["fc_w"], p["fc_b"], group, sp, ov), approximate="tanh")
    return _residual_dropout(row_linear(h, p["fc_proj_w"], p["fc_proj_b"], group, sp, ov), cfg.resid_pdrop, gen,
                             shape, plan)


def parallel_block(p: Block, x: torch.Tensor, shape: tuple[int, int], plan: TPPlan,
                   seed: int | None = None) -> torch.Tensor:
    """Attention then MLP, each added to the residual; with ``plan.compile`` in compiled regions (``compiled``)."""
    if plan.compile is not None:
        return compiled_block(p, x, shape, plan, plan.compile, seed)
    seed_attn, seed_mlp = sublayer_seeds(seed)
    x = x + parallel_attention(p, x, shape, plan, make_generator(seed_attn, x.device))
    return x + parallel_mlp(p, x, shape, plan, make_generator(seed_mlp, x.device))


def parallel_hidden_states(local: Tree, tokens: torch.Tensor, plan: TPPlan, seed: int | None = None) -> torch.Tensor:
    """embed -> blocks -> final LayerNorm, flat ``[tokens, C]``; block i uses dropout seed ``seed + 1 + i``."""
    validate_tokens(tokens, plan.cfg)
    shape = (tokens.shape[0], tokens.shape[1])
    x = parallel_embed(local, tokens, plan, seed)
    for i, p in enumerate(local["blocks"]):
        x = parallel_block(p, x, shape, plan, None if seed is None else seed + 1 + i)
    return F.layer_norm(x, (x.shape[-1],), local["ln_f_w"], local["ln_f_b"], plan.cfg.layer_norm_eps)


def parallel_loss(local: Tree, tokens: torch.Tensor, targets: torch.Tensor, plan: TPPlan, seed: int | None = None,
                  denom: int | None = None, chunk_tokens: int = 2048) -> torch.Tensor:
    """Mean next-token cross-entropy, the same on every rank of the TP group; ``targets`` as in ``model.loss``."""
    if targets.shape != tokens.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} != tokens shape {tuple(tokens.shape)}")
    h = enter_parallel(parallel_hidden_states(local, tokens, plan, seed), plan.grid.tp_group, plan.sequence_parallel)
    return vocab_parallel_cross_entropy(h, local["wte"], targets.reshape(-1), plan.vocab.start, plan.cfg.vocab_size,
                                        plan.grid.tp_group, denom, chunk_tokens)


def parallel_logits(local: Tree, tokens: torch.Tensor, plan: TPPlan) -> torch.Tensor:
    """Full ``[B, T, vocab]`` logits on every rank (inference and tests; training uses ``parallel_loss``)."""
    group = plan.grid.tp_group
    h = enter_parallel(parallel_hidden_states(local, tokens, plan), group, plan.sequence_parallel)
    logits = all_gather_split(F.linear(h, local["wte"]), group, dim=-1)[:, :plan.cfg.vocab_size]
    return logits.reshape(*tokens.shape, -1)
