"""``--compile`` with ``--tp``/``--pp``: the 3D trainer's blocks compiled between their collectives (``compose.layered``
over ``tensor_parallel.ops``' compiled block) equal the eager ones (fp32, CPU, gloo).

Two worlds: 2 ranks as tp 2 (collectives inside each block) and 3 ranks as pp 3 under 1F1B with recomputed blocks
(compiled blocks run again in backward). Each builds the same model twice, eager and compiled, and makes two AdamW
steps with each: every loss and every reduced gradient of the first step within 1e-6 relative, as
``tests/tensor_parallel/test_tp_compiled.py`` bounds the compiled TP block (the same GEMMs and reductions, only
regrouped into graphs, in fp32); and the compiled model did run compiled graphs. The backend is ``aot_eager``
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
from tests.conftest import rel_err

CFG = preset("tiny", n_layer=3, n_embd=32, n_head=4, vocab_size=251, n_ctx=16)
BATCH, SEQ, MICRO, TOL = 8, 16, 2, 1e-6
ADAM = AdamConfig(lr=1e-3, eps=1e-6)
FP32 = OffloadConfig(device="cpu", dtype=torch.float32, offload=False)
GRIDS = {2: (GridConfig(tp=2), False), 3: (GridConfig(pp=3), True)}  # world: (grid, recompute)


def run(ctx, grid: GridConfig, recompute: bool, compile) -> tuple[list[float], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, CFG.vocab_size, (2, BATCH, SEQ), generator=gen) for _ in range(2))
    p3d = build_3d(ctx, CFG, build_schedule("1f1b", grid.pp, MICRO), SEQ, BATCH // MICRO, recompute=recompute,
                   compile=compile)
    trainer = Parallel3DTrainer(p3d, ADAM, FP32, DPConfig(bucket_mb=0))
    losses = [trainer.step(tokens[0], targets[0]).loss]
    opt = trainer.opt
    grads = {path: g.clone() for b in opt.buckets for path, g in b.views(opt.reduced(b)).items()}
    losses.append(trainer.step(tokens[1], targets[1]).loss)
    trainer.close()
    return losses, grads


def worker(world: int) -> str:
    torch.set_num_threads(1)
    grid, recompute = GRIDS[world]
    ctx = init_distributed(grid, "gloo", timeout_s=120)
    with ctx.guard():
        eager_losses, eager_grads = run(ctx, grid, recompute, None)
        counter = CompileCounterWithBackend("aot_eager")
        torch._dynamo.reset()
        losses, grads = run(ctx, grid, recompute, counter)
    close_distributed(ctx)
    for step, (a, b) in enumerate(zip(losses, eager_losses)):
        assert rel_err(torch.tensor(a), torch.tensor(b)) < TOL, f"{grid}: step {step} loss {a} != eager {b}"
    assert grads.keys() == eager_grads.keys()
    for path, g in grads.items():
        assert rel_err(g, eager_grads[path]) < TOL, f"{grid}: gradient of {path}: {rel_err(g, eager_grads[path]):.2e}"
    assert counter.frame_count > 0, f"{grid}: no block was compiled"
    return "ok"


@pytest.mark.parametrize("world", sorted(GRIDS))
def test_compiled_3d_blocks_equal_the_eager_ones(world):
    assert spawn(worker, world, (world,), timeout_s=170, start_method="fork") == ["ok"] * world
