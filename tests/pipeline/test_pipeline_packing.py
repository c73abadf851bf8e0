"""Packed rows through a pipeline (2 CPU ranks; GPT-2 in whole blocks, the Llama class cut between attention and
MLP sublayers, schedules 1f1b and zb-h1 whose split backward defers the weight gradients): every stage builds
each micro-batch's mask from its positions; the loss and every gradient (both copies of a tied one included) equal
those of the batch's documents run one by one (``tests.packed_cases``: bound and reference)."""
from __future__ import annotations

import torch

from nanotrain.core.models import init_params, model_spec, preset
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from nanotrain.pipeline import LayeredModel, build_pipeline, build_schedule, train_step
from tests.conftest import rel_err
from tests.packed_cases import one_by_one, packed_batch, packed_rtol

MICRO, MB, SEQ = 2, 2, 16
MODELS = {"gpt2": (preset("tiny", n_layer=2, vocab_size=128, n_ctx=SEQ), False),
          "llama": (preset("tiny-llama", n_layer=2), True)}
SCHEDULES = ("1f1b", "zb-h1")


def worker() -> dict:
    ctx = init_distributed(GridConfig(pp=launched_world_size()), "gloo", timeout_s=60)
    out = {}
    with ctx.guard():
        for name, (cfg, sublayers) in MODELS.items():
            tokens, targets, positions = (t.view(MICRO, MB, SEQ) for t in packed_batch(cfg.vocab_size, MICRO * MB, SEQ))
            for schedule in SCHEDULES:
                pipe = build_pipeline(ctx, LayeredModel.from_spec(cfg, SEQ, sublayers=sublayers),
                                      build_schedule(schedule, ctx.world_size, MICRO, 1), tokens[0], seed=1)
                loss = float(train_step(pipe, None, tokens, targets, positions=positions))
                out[(name, schedule)] = (loss, {path: t.grad.clone() for path, t in pipe.named_parameters()})
    close_distributed(ctx)
    return out


def test_pipeline_on_packed_rows():
    per_rank = spawn(worker, 2, timeout_s=180, start_method="fork")
    for name, (cfg, _) in MODELS.items():
        spec = model_spec(cfg)
        batch = packed_batch(cfg.vocab_size, MICRO * MB, SEQ)
        want_loss, want = one_by_one(spec, init_params(spec, seed=1), *batch)
        loss_rtol, grad_rtol = packed_rtol(cfg, batch[0], "loss"), packed_rtol(cfg, batch[0])
        for schedule in SCHEDULES:
            seen = set()
            for rank in per_rank:
                loss, grads = rank[(name, schedule)]
                assert abs(loss - want_loss) <= loss_rtol * want_loss, (name, schedule)
                for path, g in grads.items():
                    assert rel_err(g, want[path]) <= grad_rtol, (name, schedule, path)
                    seen.add(path)
            assert seen == set(want), (name, schedule)
