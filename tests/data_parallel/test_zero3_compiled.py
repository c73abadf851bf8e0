"""ZeRO-3 with compiled blocks and nothing recomputed: each segment's compiled graph kept while its gathered weights'
memory is released and gathered back under it (``data_parallel.zero3``) equals the eager run (fp32, CPU, gloo, 3
ranks).

Both runs make two AdamW steps from the same weights: the same GEMMs and reductions, only regrouped into graphs, in
fp32: the first loss and every reduced gradient shard of the first step within ``conftest.chain_rtol`` of the
reductions they come out of, the second loss within that plus what the first step's updates, AdamW of those
gradients, move it (``conftest.adam_bounds``, summed over the ranks' shards); the compiled run compiled one graph
for every block and step, whatever the family, and held no unit gathered after its steps. The backend is
``aot_eager`` (dynamo's and AOT autograd's tracing and partitioning, which choose what a graph keeps for backward,
without inductor's C++ code generation, which takes minutes on two cores); the GPU runs use inductor.
"""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from nanotrain.core.models import init_params, preset
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.resident import TrainConfig
from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, spawn
from tests.conftest import adam_bounds, chain_rtol, model_chain, rel_err

# a Llama and a Qwen 2.5 (q/k/v biases: one more leaf in each block's flat tensor), rope left as Qwen's (unscaled)
CONFIGS = {"llama": preset("tiny-llama", n_layer=3),
           "qwen2": preset("tiny-llama", n_layer=3, architecture="qwen2", rope_scaling=None)}
BATCH, SEQ, MICRO, WORLD = 6, 16, 1, 3
ADAM = AdamConfig(lr=1e-3, eps=1e-6)
CPU32 = OffloadConfig(device="cpu", dtype=torch.float32, offload=False)


def run(cfg: Any, compile: bool) -> tuple[list[float], list[dict], dict, int]:
    """Two steps: the losses, each step's reduced gradient shards by bucket, this rank's shards of the weights
    before the first step, the units still gathered after the last."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, BATCH, SEQ + 1), generator=gen)
    tcfg = TrainConfig(batch=BATCH, micro_batch=MICRO, recompute="none", compile=compile)
    trainer = data_parallel_trainer(cfg, init_params(cfg, seed=1), tcfg, ADAM, CPU32, DPConfig(zero=3),
                                    dist.group.WORLD)
    opt, grads = trainer.opt, []
    start = {b.name: opt.new_shard(b).clone() for b in trainer.inner.weights.buckets}
    update = opt.update
    opt.update = lambda b, reduced: (grads[-1].__setitem__(b.name, reduced.clone()), update(b, reduced))
    losses = []
    for s in range(2):
        grads.append({})
        losses.append(trainer.step(tokens[s, :, :-1], tokens[s, :, 1:]).loss)
    held = len(trainer.inner.weights.held())
    trainer.close()
    return losses, grads, start, held


def worker(cfg: Any) -> tuple[list[float], list[float], float, list[str]]:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=WORLD), "gloo", timeout_s=120)
    with ctx.guard():
        eager_losses, eager_grads, start, _ = run(cfg, compile=False)
        counter = CompileCounterWithBackend("aot_eager")
        torch._dynamo.reset()
        counters.clear()
        torch.compile = functools.partial(torch.compile, backend=counter)  # this forked rank's only
        losses, grads, _, held = run(cfg, compile=True)
    close_distributed(ctx)
    grad_rtol = chain_rtol(model_chain(cfg, SEQ, BATCH * SEQ))
    wrong = [f"{name}: {rel_err(g, eager_grads[0][name]):.2e}" for name, g in grads[0].items()
             if rel_err(g, eager_grads[0][name]) > grad_rtol]
    # one frame and one graph for every block and step: each block's leaves are views of its own gathered flat tensor,
    # at the same offsets in every block, so no guard of dynamo's fails between blocks and nothing breaks the graph (a
    # recompile per block would hold a compiled graph per block in host memory: COMPILE_HOST_BYTES counts one)
    frames = counters["frames"]["total"]
    wrong += [] if (frames, counter.frame_count) == (1, 1) else [f"the block compiled as {frames} frames, "
                                                                 f"{counter.frame_count} graphs, not 1 and 1: "
                                                                 f"{dict(counters['graph_break'])}"]
    wrong += [] if held == 0 else [f"{held} units still gathered after the steps"]
    return losses, eager_losses, adam_bounds(start, grads, eager_grads, ADAM)[1][1], wrong


@pytest.mark.parametrize("family", CONFIGS)
def test_compiled_zero3_blocks_keep_their_graphs_and_equal_the_eager_ones(family):
    cfg = CONFIGS[family]
    per_rank = spawn(worker, WORLD, (cfg,), timeout_s=170, start_method="fork")
    loss_rtol = chain_rtol(model_chain(cfg, SEQ, BATCH * SEQ, "loss"))
    moved = sum(m for _, _, m, _ in per_rank)  # each rank's shards: the whole model once
    for rank, (losses, eager_losses, _, wrong) in enumerate(per_rank):
        assert not wrong, (rank, wrong)
        for step, (a, b) in enumerate(zip(losses, eager_losses, strict=True)):
            assert abs(a - b) <= loss_rtol * abs(b) + (moved if step else 0.0), (rank, step, losses, eager_losses)
