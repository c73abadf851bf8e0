"""A tensor-parallel GPT-2 block whose local compute runs as ``torch.compile``d regions.

The collectives stay *between* the compiled regions, run eagerly by the same autograd functions as
the eager block (``comms``, ``overlap``); each region is pure local tensor code, traced whole
(``fullgraph=True``: a graph break is an error, not a silent fallback). Per block:

======================  ==========================================  ====================================
region (compiled)       computes                                    then (eager)
======================  ==========================================  ====================================
``ln``                  ln_1                                        enter: f, or the sp all-gather
``qkv_attention_proj``  qkv, attention, partial projection          leave: all-reduce, or reduce-scatter
``residual_ln``         proj bias + residual add, ln_2              enter
``fc_gelu_proj``        fc, GELU, partial projection                leave
``residual``            fc_proj bias + residual add                 (the next block's ``ln``)
======================  ==========================================  ====================================

With ``overlap`` the column/row matmuls are fused with their collectives (``overlap``), so they
stay eager too and the regions shrink to ``attention`` and ``gelu`` between them.

Why not trace the collectives inside the regions: on torch 2.13 ``torch._dynamo.explain`` traces
the whole collectives of ``comms`` without a break (it rewrites them to functional collectives),
but breaks the graph at every ``async_op=True`` all-reduce and every ``P2POp`` ring step of
``overlap`` (P2P tracing is off unless an environment variable turns it on). Regions of local
tensor code lean on none of that, so they compile alike on torch 2.11 and 2.13, with NCCL or
gloo, overlapped or not, and the communication is exactly the eager step's.

Exactness: every op, its operands and their order are the eager block's (``gpt2``), so with a
backend that does not fuse (``aot_eager``) the step is the eager step's to rounding; inductor
fuses elementwise work and may differ by fp32 rounding. Dropout is exact too: dynamo cannot trace a
``torch.Generator``, so each sublayer's masks are drawn eagerly, as the eager block draws them, and
enter the regions as boolean tensors (a region with a mask is its own graph).
"""
from __future__ import annotations

import math
from functools import cache
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F

from nanotrain.models.gpt2 import GPT2Config
from nanotrain.linear import linear
from nanotrain.model import Block, causal_attention, make_generator, merge_heads, split_heads, sublayer_seeds
from nanotrain.tensor_parallel.layers import autocast_inputs, column_linear, enter_parallel, leave_parallel, row_linear
from nanotrain.tensor_parallel.shard import TPPlan, token_range

Backend = str | Callable


def _ln(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _dropout(x: torch.Tensor, keep: torch.Tensor | None, p: float) -> torch.Tensor:
    return x if keep is None else x * keep.to(x.dtype) / (1.0 - p)


def _attention(qkv: torch.Tensor, b: int, t: int, cfg: GPT2Config, keep: torch.Tensor | None) -> torch.Tensor:
    """This rank's heads of ``qkv`` [b*t, 3*h*d] -> causal attention -> [b*t, h*d]; ``keep``: its dropout mask."""
    q, k, v = split_heads(qkv.view(b, t, -1), cfg)
    if keep is None:
        return merge_heads(causal_attention(q, k, v, 0.0, None)).view(b * t, -1)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # as gpt2._attention_core
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    att = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return merge_heads(_dropout(att, keep, cfg.attn_pdrop) @ v).view(b * t, -1)


def _qkv_attention_proj(h: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor, proj_w: torch.Tensor,
                        b: int, t: int, cfg: GPT2Config, keep: torch.Tensor | None) -> torch.Tensor:
    """Column-parallel qkv, attention, this rank's partial row-parallel projection (no bias: it is added once)."""
    return linear(_attention(linear(h, qkv_w, qkv_b), b, t, cfg, keep), proj_w)


def _gelu(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h, approximate="tanh")


def _fc_gelu_proj(h: torch.Tensor, fc_w: torch.Tensor, fc_b: torch.Tensor, proj_w: torch.Tensor) -> torch.Tensor:
    return linear(_gelu(linear(h, fc_w, fc_b)), proj_w)


def _residual(x: torch.Tensor, summed: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor | None,
              p: float) -> torch.Tensor:
    return x + _dropout(summed + bias, keep, p)


def _residual_ln(x: torch.Tensor, summed: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor | None, p: float,
                 w: torch.Tensor, b: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = _residual(x, summed, bias, keep, p)
    return x, _ln(x, w, b, eps)


REGIONS = {"ln": _ln, "attention": _attention, "qkv_attention_proj": _qkv_attention_proj, "gelu": _gelu,
           "fc_gelu_proj": _fc_gelu_proj, "residual": _residual, "residual_ln": _residual_ln}


@cache
def regions(backend: Backend) -> SimpleNamespace:
    """The regions compiled once per backend (shapes static: one graph per region, shape and grad mode)."""
    return SimpleNamespace(**{name: torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)
                              for name, fn in REGIONS.items()})


def _enter(h: torch.Tensor, plan: TPPlan) -> torch.Tensor:
    (h,) = autocast_inputs(h)  # as ``column_linear``: the gather and the gradient's reduction move the compute dtype
    return enter_parallel(h, plan.grid.tp_group, plan.sequence_parallel)


def _keep(p: float, gen: torch.Generator | None, full_shape: tuple[int, ...], take: Callable,
          device: torch.device) -> torch.Tensor | None:
    """This rank's part of the mask the single-process model draws for the whole tensor (``gpt2._sliced_dropout``)."""
    if gen is None or p == 0.0:
        return None
    return take(torch.rand(full_shape, generator=gen, device=device, dtype=torch.float32) >= p)


def _masks(plan: TPPlan, shape: tuple[int, int], seed: int | None,
           device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Attention, attention-residual and MLP-residual dropout masks, drawn from each sublayer's generator in the
    eager block's order (``gpt2.parallel_block``)."""
    cfg, (b, t), heads = plan.cfg, shape, plan.heads
    tokens = token_range(b * t, plan)
    gen_attn, gen_mlp = (make_generator(s, device) for s in sublayer_seeds(seed))

    def residual(gen: torch.Generator | None) -> torch.Tensor | None:
        return _keep(cfg.resid_pdrop, gen, (b, t, cfg.n_embd), lambda m: m.view(b * t, -1)[tokens.start:tokens.stop],
                     device)
    attn = _keep(cfg.attn_pdrop, gen_attn, (b, cfg.n_head, t, t), lambda m: m[:, heads.start:heads.stop], device)
    return attn, residual(gen_attn), residual(gen_mlp)


def compiled_block(p: Block, x: torch.Tensor, shape: tuple[int, int], plan: TPPlan, backend: Backend,
                   seed: int | None = None) -> torch.Tensor:
    """``gpt2.parallel_block`` with its local compute in compiled regions, the dropout masks drawn outside them."""
    cfg, group, sp = plan.cfg, plan.grid.tp_group, plan.sequence_parallel
    fns, (b, t), eps = regions(backend), shape, cfg.layer_norm_eps
    keep_attn, keep_attn_out, keep_mlp_out = _masks(plan, shape, seed, x.device)
    h = fns.ln(x, p["ln_1_w"], p["ln_1_b"], eps)
    if plan.overlap:
        qkv = column_linear(h, p["qkv_w"], p["qkv_b"], group, sp, overlap=True)
        summed = row_linear(fns.attention(qkv, b, t, cfg, keep_attn), p["proj_w"], None, group, sp, overlap=True)
    else:
        summed = leave_parallel(fns.qkv_attention_proj(_enter(h, plan), p["qkv_w"], p["qkv_b"], p["proj_w"], b, t,
                                                       cfg, keep_attn), group, sp)
    x, h = fns.residual_ln(x, summed, p["proj_b"], keep_attn_out, cfg.resid_pdrop, p["ln_2_w"], p["ln_2_b"], eps)
    if plan.overlap:
        hidden = column_linear(h, p["fc_w"], p["fc_b"], group, sp, overlap=True)
        summed = row_linear(fns.gelu(hidden), p["fc_proj_w"], None, group, sp, overlap=True)
    else:
        summed = leave_parallel(fns.fc_gelu_proj(_enter(h, plan), p["fc_w"], p["fc_b"], p["fc_proj_w"]), group, sp)
    return fns.residual(x, summed, p["fc_proj_b"], keep_mlp_out, cfg.resid_pdrop)
