"""Each family's activation table (``Costs.act_bytes``) against what a block's forward saves for its backward.

One bf16 block per family runs on the CPU and every tensor its forward saves is counted (``saved_tensors_hooks``):
once per storage (q, k and v may be views of q|k|v), less the weights, and only tensors with a token dimension
(the rotary inverse frequencies are the block's, not a token's). The counts are numbers of bytes: exact, no
rounding, the same on any CPU and thread count.

``compiled``: the resident and data-parallel trainers compile a block they do not recompute with ``torch.compile``'s
default backend (``core.recompute.RecomputePolicy.block_fn``): inductor, whose partitioner
(``min_cut_rematerialization_partition``, the same code on every device) chooses what the forward saves. Where the
CPU differs from a GPU, the difference is named: a CPU's LayerNorm keeps its mean and reciprocal deviation in the
input's dtype, a GPU's in fp32 (``torch._refs.native_layer_norm``). On a GPU the count agrees with the peaks measured
(gpt2-large, H100, torch 2.11, compiled: the allocated peak at micro-batch 32 less that at 16, less the LM head's
input, over the tokens and blocks, is 41,198 bytes against 41,056 counted).

``none`` and ``lean`` (eager autograd, ``core.lean``): the Llama class's are exact but for the rotary tables,
``[T, D]`` shared by a micro-batch's rows, counted per token as at one row. GPT-2's are Korthikanti et al.'s 34 C
and 22 C, which the streamed footprint's fitted backward temporaries stand on: upper bounds (autograd keeps
32 C + 4 H and the LayerNorms' statistics, 20 C + 4 H lean), never below what is saved.
"""
from __future__ import annotations

import pytest
import torch

from nanotrain.core.lean import LEAN
from nanotrain.core.models import init_params, model_spec, run
from nanotrain.core.models.gpt2.config import GPT2Config
from nanotrain.core.models.llama.config import LlamaConfig
from nanotrain.core.models.ops import PLAIN

B, T = 3, 64  # no width, head count or head dim of the configs below is 64 or 192, so a token dimension is plain
# Widths small enough to compile in seconds; head dims and neurons unlike the width, so that a swapped term shows.
CASES = {
    "llama": LlamaConfig(n_layer=1, n_embd=256, n_head=8, n_kv_head=2, intermediate_size=704, vocab_size=512),
    "qwen3": LlamaConfig(n_layer=1, n_embd=256, n_head=8, n_kv_head=2, head_dim=48, intermediate_size=704,
                         vocab_size=512, architecture="qwen3"),
    "gpt2": GPT2Config(n_layer=1, n_embd=256, n_head=8, vocab_size=512, n_ctx=256),
}
# Two LayerNorms' mean and reciprocal deviation, 2 bytes each in bf16 on the CPU against 4 in fp32 on a GPU.
CPU_LAYER_NORM_STATS = {"llama": 0, "qwen3": 0, "gpt2": 2 * 2 * (4 - 2)}


def saved_bytes(cfg: LlamaConfig | GPT2Config, block=run.block, ops=PLAIN, device: str = "cpu") -> int:
    """The bytes that one bf16 ``block`` over B x T tokens saves for its backward (see the module docstring)."""
    spec = model_spec(cfg)
    p = {k: v.requires_grad_() for k, v in init_params(cfg, dtype=torch.bfloat16, device=device)["blocks"][0].items()}
    x = torch.randn(B, T, spec.width, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    x = x.to(device).requires_grad_()
    weights = {w.untyped_storage().data_ptr() for w in p.values()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights and (T in t.shape or B * T in t.shape):
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(spec, p, x, ops)
    return sum(saved.values())


@pytest.mark.parametrize("family", sorted(CASES))
def test_the_compiled_count_is_what_inductor_saves(family):
    """Llama (grouped-query attention), Qwen3 (per-head q/k norms, a head dim unlike width / heads) and GPT-2."""
    cfg = CASES[family]
    counted = model_spec(cfg).costs.activation_bytes("compiled")
    saved = saved_bytes(cfg, torch.compile(run.block, dynamic=False))
    assert saved == (counted - CPU_LAYER_NORM_STATS[family]) * B * T


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", sorted(CASES))
def test_the_compiled_count_is_what_inductor_saves_on_a_gpu(family):
    """The table's own claim, where the plans run: on a GPU nothing is subtracted (flash attention's random state,
    scalars, has no token dimension)."""
    cfg = CASES[family]
    counted = model_spec(cfg).costs.activation_bytes("compiled")
    assert saved_bytes(cfg, torch.compile(run.block, dynamic=False), device="cuda") == counted * B * T


@pytest.mark.parametrize("policy, ops", [("none", PLAIN), ("lean", LEAN)])
@pytest.mark.parametrize("family", sorted(CASES))
def test_the_eager_counts_are_what_autograd_saves(family, policy, ops):
    cfg = CASES[family]
    counted, saved = model_spec(cfg).costs.activation_bytes(policy) * B * T, saved_bytes(cfg, ops=ops)
    if family == "gpt2":
        assert saved <= counted
    else:  # cos and sin, 2 D bytes a position each, counted for each of the B rows, kept once
        assert saved == counted - 4 * cfg.heads[2] * (B - 1) * T
