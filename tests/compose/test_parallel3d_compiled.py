"""``--compile`` with ``--tp``/``--pp``: the 3D trainer's blocks compiled between their collectives (``compose.layered``
over ``tensor_parallel.ops``' compiled block) equal the eager ones (fp32, CPU, gloo).

Two worlds: 2 ranks as tp 2 (collectives inside each block) and 3 ranks as pp 3 under 1F1B with recomputed blocks
(compiled blocks run again in backward). Each builds the same model twice, eager and compiled, and makes two AdamW
steps with each: the same GEMMs and reductions, only regrouped into graphs, in fp32: the first loss and every
reduced gradient of the first step within ``conftest.chain_rtol`` of the reductions they come out of, the second
loss within that plus what the first step's updates, AdamW of those gradients, move it (``conftest.adam_bounds``,
summed over the ranks); and the compiled model did run compiled graphs. The backend is ``aot_eager``
(dynamo and AOT autograd's tracing, not inductor's C++ code generation, which takes minutes on two cores); the
GPU runs use inductor.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from nanotrain.compose import Parallel3DTrainer, build_3d
from nanotrain.core.models import preset
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.data_parallel import DPConfig
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, spawn
from nanotrain.pipeline import build_schedule
from tests.conftest import adam_bounds, chain_rtol, model_chain, rel_err

CFG = preset("tiny", n_layer=3, n_embd=32, n_head=4, vocab_size=251, n_ctx=16)
BATCH, SEQ, MICRO = 8, 16, 2
ADAM = AdamConfig(lr=1e-3, eps=1e-6)
FP32 = OffloadConfig(device="cpu", dtype=torch.float32, offload=False)
GRIDS = {2: (GridConfig(tp=2), False), 3: (GridConfig(pp=3), True)}  # world: (grid, recompute)


def run(ctx, grid: GridConfig, recompute: bool, compile) -> tuple[list[float], list[dict], dict[str, torch.Tensor]]:
    """Two steps: the losses, each step's reduced gradients (this rank's), the weights before the first."""
    gen = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, CFG.vocab_size, (2, BATCH, SEQ), generator=gen) for _ in range(2))
    p3d = build_3d(ctx, CFG, build_schedule("1f1b", grid.pp, MICRO), SEQ, BATCH // MICRO, recompute=recompute,
                   compile=compile)
    trainer = Parallel3DTrainer(p3d, ADAM, FP32, DPConfig(bucket_mb=0))
    start = {path: t.detach().clone() for path, t in trainer.named_parameters()}
    opt, losses, grads = trainer.opt, [], []
    for s in range(2):
        losses.append(trainer.step(tokens[s], targets[s]).loss)
        grads.append({path: g.clone() for b in opt.buckets for path, g in b.views(opt.reduced(b)).items()})
    trainer.close()
    return losses, grads, start


def worker(world: int) -> tuple[list[float], list[float], float]:
    """This rank's checks of the first step's gradients; both runs' losses and how far this rank's first updates may
    move the second (``conftest.adam_bounds``)."""
    torch.set_num_threads(1)
    grid, recompute = GRIDS[world]
    ctx = init_distributed(grid, "gloo", timeout_s=120)
    with ctx.guard():
        eager_losses, eager_grads, start = run(ctx, grid, recompute, None)
        counter = CompileCounterWithBackend("aot_eager")
        torch._dynamo.reset()
        losses, grads, _ = run(ctx, grid, recompute, counter)
    close_distributed(ctx)
    grad_rtol = chain_rtol(model_chain(CFG, SEQ, BATCH * SEQ))  # 4.6e-5: forward, backward, the sum over tokens
    assert grads[0].keys() == eager_grads[0].keys()
    for path, g in grads[0].items():
        err = rel_err(g, eager_grads[0][path])
        assert err <= grad_rtol, f"{grid}: gradient of {path}: {err:.2e}"
    assert counter.frame_count > 0, f"{grid}: no block was compiled"
    return losses, eager_losses, adam_bounds(start, grads, eager_grads, ADAM)[1][1]


@pytest.mark.parametrize("world", sorted(GRIDS))
def test_compiled_3d_blocks_equal_the_eager_ones(world):
    per_rank = spawn(worker, world, (world,), timeout_s=170, start_method="fork")
    loss_rtol = chain_rtol(model_chain(CFG, SEQ, BATCH * SEQ, "loss"))  # 2.3e-5: 3 blocks, head, the mean
    moved = sum(m for _, _, m in per_rank)  # TP's replicated leaves counted on each rank: an upper bound
    for rank, (losses, eager_losses, _) in enumerate(per_rank):
        for step, (a, b) in enumerate(zip(losses, eager_losses, strict=True)):
            bound = loss_rtol * abs(b) + (moved if step else 0.0)
            assert abs(a - b) <= bound, f"world {world}, rank {rank}: step {step} loss {a} != eager {b}"
