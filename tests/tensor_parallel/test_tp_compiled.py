"""The compiled tensor-parallel block (``tensor_parallel.ops``, ``plan.compile``) against the eager TP step, on CPU
with gloo.

TP=2 and TP=3 (heads 3/2 and 2/2/1), with and without sequence parallelism and overlap: loss and every gradient (after
``sync_grads``) within 1e-6 relative of the eager step (fp32, with seeded dropout, and under bf16
autocast, where ``aot_eager`` runs the same casts and GEMMs), the same collectives, and the block compiled into the
regions between its collectives and nothing else: dynamo breaks the graph at each collective, so the graph count
says where it broke; the graphs are shared by both blocks and not recompiled on the next step. The backend is
``aot_eager``: it runs dynamo and AOT autograd's tracing of forward and backward, but not inductor's C++ code
generation, which would take minutes on this machine's two cores; the GPU runs use inductor.
"""
from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from nanotrain.core import models
from nanotrain.core.models import model_spec, preset
from nanotrain.distributed import run_in_group, spawn
from nanotrain.distributed.grid import GridConfig, build_grid
from nanotrain.tensor_parallel import parallel_loss, plan_tp, shard_params, sync_grads
from nanotrain.core.tree import named_leaves
from tests.conftest import chain_rtol, model_chain, rel_err
from tests.tensor_parallel.test_tp_gpt2 import DROPOUT, batch, count_collectives, leaves_requiring_grad

# Uneven heads; dropout only where a seed is given.
GPT2 = preset("tiny", n_layer=2, n_embd=40, n_head=5, vocab_size=251, n_ctx=32, **DROPOUT)
# Grouped-query attention (6 query heads over 3 key/value heads), rotary positions, SwiGLU, no biases, attention
# dropout only: the same regions (with no bias on the output projection its residual region is the add alone).
LLAMA = preset("tiny-llama", n_kv_head=3, attention_dropout=0.1)
REGIONS_USED = 5  # norm | attention (+ matmuls without overlap) | residual, norm | activation (+ matmuls) | residual
# With dropout every region is compiled once more: the masks enter the block as tensors (drawn eagerly before it,
# dynamo cannot trace a generator), and each region's guards see them, as inputs of the sublayers it passes them to or
# as live values it hands on to the regions after it.
DROPOUT_REGIONS = REGIONS_USED


def step(plan, local, i: int, bf16: bool, seed: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor], object]:
    for _, p in named_leaves(local):
        p.grad = None
    with count_collectives(by_dtype=True) as counts:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = parallel_loss(local, *batch(20 + i, t=24), plan, seed=seed, chunk_tokens=16)
        loss.backward()
    sync_grads(local, plan)
    return loss.detach(), [p.grad.clone() for _, p in named_leaves(local)], counts


def check_compiled(grid, cfg, sp: bool, overlap: bool) -> None:
    """Steps 0, 1: fp32; 2: bf16 autocast; 3, 4: fp32 with dropout of two seeds (masks drawn outside the regions).
    ``cfg`` has dropout, used only where a seed is given."""
    where = f"{model_spec(cfg).family} sp={sp} overlap={overlap}"
    eager_plan = plan_tp(cfg, grid, sequence_parallel=sp, overlap=overlap)
    counter = CompileCounterWithBackend("aot_eager")
    plan = plan_tp(cfg, grid, sequence_parallel=sp, overlap=overlap, compile=counter)
    torch._dynamo.reset()
    eager = leaves_requiring_grad(shard_params(models.init_params(cfg, 0), eager_plan))
    compiled = leaves_requiring_grad(shard_params(models.init_params(cfg, 0), plan))
    # the same aten ops, traced (bf16's roundings where eager's are): only the fp32 sums' order may differ
    loss_rtol, grad_rtol = (chain_rtol(model_chain(cfg, 24, 48, what)) for what in ("loss", "grads"))
    for i, (bf16, seed) in enumerate(((False, None), (False, None), (True, None), (False, 5), (False, 6))):
        ref_loss, ref_grads, ref_counts = step(eager_plan, eager, i, bf16, seed)
        loss, grads, counts = step(plan, compiled, i, bf16, seed)
        assert rel_err(loss, ref_loss) < loss_rtol, f"step {i}: loss {loss.item()} != eager {ref_loss.item()} ({where})"
        for (name, _), g, e in zip(named_leaves(compiled), grads, ref_grads):
            err = rel_err(g, e)
            assert err < grad_rtol, f"step {i}: grad of {name}: relative error {err:.2e} ({where})"
        assert counts == ref_counts, f"step {i}: compiled collectives {dict(counts)} != eager {dict(ref_counts)}"
        # One graph per region for both blocks, none more on the second step (no recompiles); autocast is
        # a new graph per region, its casts traced; dropout DROPOUT_REGIONS more, whatever the seed (it stays out).
        graphs = REGIONS_USED * (1 + (i >= 2)) + (DROPOUT_REGIONS if i >= 3 else 0)
        assert counter.frame_count == graphs, f"step {i}: {counter.frame_count} graphs, not {graphs} ({where})"


def _world(rank: int, world: int, cfg=GPT2) -> None:
    grid = build_grid(GridConfig(tp=world))
    for sp in (False, True):
        for overlap in (False, True):
            check_compiled(grid, cfg, sp, overlap)


def _llama(rank: int, world: int) -> None:
    _world(rank, world, LLAMA)


def test_compiled_tp2_equals_eager_tp2():
    spawn(run_in_group, 2, ("gloo", _world), timeout_s=120, start_method="fork")


def test_compiled_tp3_equals_eager_tp3():
    spawn(run_in_group, 3, ("gloo", _world), timeout_s=120, start_method="fork")


def test_compiled_llama_tp2_equals_eager_tp2():
    spawn(run_in_group, 2, ("gloo", _llama), timeout_s=120, start_method="fork")
