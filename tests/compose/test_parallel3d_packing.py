"""Packed rows under 3D parallelism (4 CPU ranks: tp=2 with sequence parallelism x pp=2, and tp=2 x dp=2 without
it): each replica's rows take their positions, every stage builds each micro-batch's mask, each TP rank embeds its
tokens' positions. Validation, the first step's loss and every reduced gradient equal those of the global batch's
documents run one by one (``tests.packed_cases``: bound and reference)."""
from __future__ import annotations

import torch

from nanotrain.compose import Parallel3DTrainer, build_3d
from nanotrain.core.models import init_params, model_spec, preset
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.data_parallel import DPConfig
from nanotrain.distributed import GridConfig, build_grid, close_distributed, init_distributed, spawn
from nanotrain.pipeline import build_schedule
from nanotrain.tensor_parallel.shard import TPPlan, shard_leaf
from tests.conftest import rel_err
from tests.packed_cases import one_by_one, packed_batch, packed_rtol

SEQ, ROWS, MICRO = 16, 8, 2
MODELS = {"gpt2": preset("tiny", n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_ctx=SEQ),
          "llama": preset("tiny-llama", n_layer=2)}
LAYOUTS = {"tp2 sp x pp2": (GridConfig(tp=2, pp=2, dp=1), True), "tp2 x dp2": (GridConfig(tp=2, pp=1, dp=2), False)}


def worker() -> dict:
    ctx = init_distributed(GridConfig(dp=4), "gloo", timeout_s=120)
    out = {}
    with ctx.guard():
        for name, cfg in MODELS.items():
            batch = packed_batch(cfg.vocab_size, ROWS, SEQ)
            for layout, (grid, sp) in LAYOUTS.items():
                ctx.grid = build_grid(grid, timeout=ctx.grid.timeout)
                p3d = build_3d(ctx, cfg, build_schedule("1f1b", grid.pp, MICRO, 1), SEQ, ROWS // (grid.dp * MICRO),
                               sequence_parallel=sp, seed=1)
                trainer = Parallel3DTrainer(p3d, AdamConfig(), OffloadConfig(device="cpu", dtype=torch.float32,
                                                                             offload=False), DPConfig(bucket_mb=0))
                evaluated = trainer.eval_loss(*batch)
                loss = trainer.step(*batch).loss
                opt = trainer.opt
                grads = {path: g.clone() for b in opt.buckets for path, g in b.views(opt.reduced(b)).items()}
                plan = p3d.plan
                ranges = (plan.q_heads, plan.kv_heads, plan.neurons, plan.vocab, plan.padded_vocab)
                out[(name, layout)] = (evaluated, loss, grads, ranges)
                trainer.close()
    close_distributed(ctx)
    return out


def test_3d_on_packed_rows():
    per_rank = spawn(worker, 4, timeout_s=240, start_method="fork")
    for name, cfg in MODELS.items():
        spec = model_spec(cfg)
        batch = packed_batch(cfg.vocab_size, ROWS, SEQ)
        want_loss, want = one_by_one(spec, init_params(spec, seed=1), *batch)
        loss_rtol, grad_rtol = packed_rtol(cfg, batch[0], "loss"), packed_rtol(cfg, batch[0])
        for layout, (_, sp) in LAYOUTS.items():
            seen = set()
            for rank in per_rank:
                evaluated, loss, grads, ranges = rank[(name, layout)]
                assert abs(evaluated - want_loss) <= loss_rtol * want_loss, (name, layout)
                assert abs(loss - want_loss) <= loss_rtol * want_loss, (name, layout)
                plan = TPPlan(spec, None, sp, *ranges)
                for path, g in grads.items():
                    assert rel_err(g, shard_leaf(path, want[path], plan)) <= grad_rtol, (name, layout, path)
                seen |= set(grads)
            assert seen == set(want), (name, layout)
