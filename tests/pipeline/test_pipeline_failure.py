"""A rank that fails stops every rank quickly, each naming the failing rank and stage."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from nanotrain.distributed import (GridConfig, SpawnError, close_distributed, init_distributed, launched_world_size,
                                   spawn)
from nanotrain.core.models import preset
from nanotrain.pipeline import Layer, LayeredModel, build_pipeline, build_schedule, train_step

CFG = preset("tiny", n_layer=2, n_embd=8, n_head=2, n_ctx=4, vocab_size=16)


class FailOnThirdCall:
    """A layer body that works twice, then raises: stage 1's forward of micro-batch 2 under 1F1B."""

    def __init__(self, apply):
        self.apply, self.calls = apply, 0

    def __call__(self, params, x):
        self.calls += 1
        if self.calls == 3:
            raise ValueError("injected failure")
        return self.apply(params, x)


def failing_worker() -> None:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(pp=launched_world_size()), "gloo", timeout_s=60)
    model = LayeredModel.from_spec(CFG)
    last = model.layers[-1]
    model = dataclasses.replace(model, layers=model.layers[:-1] + (
        Layer(last.name, last.paths, FailOnThirdCall(last.apply), last.cost),))
    tokens = torch.randint(0, CFG.vocab_size, (4, 1, CFG.n_ctx))
    with ctx.guard():
        pipe = build_pipeline(ctx, model, build_schedule("1f1b", 2, 4), tokens[0])
        train_step(pipe, None, tokens, tokens)
    close_distributed(ctx)


def test_a_failing_rank_stops_all_ranks_with_its_name():
    start = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(failing_worker, 2, timeout_s=60, start_method="fork")
    elapsed = time.monotonic() - start
    assert info.value.exit_codes == [1, 1], info.value  # both exited by themselves, none was killed
    assert elapsed < 30, f"took {elapsed:.0f} s to stop"
    culprit = "rank 1 failed during stage 1, forward of micro-batch 2: ValueError: injected failure"
    rank0, rank1 = info.value.logs.split("--- rank 1")
    assert culprit in rank1
    assert culprit in rank0, rank0  # the healthy rank says who failed, not just that its peer vanished
