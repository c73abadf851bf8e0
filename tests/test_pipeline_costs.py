"""Measured layer costs, per-action replay costs and the action clock (CPU)."""
from __future__ import annotations

import time

import torch

from nanotrain.config import GPT2Config
from nanotrain.pipeline import Action, build_schedule, bubble_fraction, gpt2_layered, partition
from nanotrain.pipeline.clock import ActionClock, mean_ms_by_kind
from nanotrain.pipeline.costs import cost_list, measured_costs, with_costs

CFG = GPT2Config.from_name("tiny", n_layer=4, n_embd=32, n_head=4, n_ctx=16, vocab_size=256)


def test_measured_costs_replace_only_the_costs():
    model = gpt2_layered(CFG, 16)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    measured = measured_costs(model, tokens, tokens, torch.device("cpu"), repeats=1)
    costs = cost_list(measured)
    assert len(costs) == CFG.n_layer + 2 and all(c > 0 for c in costs)
    assert [layer.name for layer in measured.layers] == [layer.name for layer in model.layers]
    assert cost_list(with_costs(model, costs)) == costs
    stages = partition(measured, 2)
    assert sum(len(s.layers) for s in stages) == CFG.n_layer and stages[-1].head is not None


def test_replay_with_per_action_costs():
    schedule = build_schedule("1f1b", 4, 8)
    unit = bubble_fraction(schedule)
    assert abs(bubble_fraction(schedule, lambda a: {"F": 1, "B": 2}[a.kind]) - unit) < 1e-12
    # A slow last stage is the pipeline's pace: more idle on the others.
    assert bubble_fraction(schedule, lambda a: (2 if a.stage == 3 else 1) * {"F": 1, "B": 2}[a.kind]) > unit + 0.1


def test_action_clock_spans_and_means():
    clock = ActionClock(torch.device("cpu"))
    for _ in range(2):
        clock.start_step()
        for mb in range(2):
            with clock(Action(0, "F", mb)):
                time.sleep(0.002)
    spans = clock.spans()
    assert [a.mb for a, _, _ in spans] == [0, 1] and spans[0][1] < spans[0][2] <= spans[1][1]
    assert mean_ms_by_kind(spans)[(0, "F")] >= 2.0
    assert 0.004 <= clock.busy_per_step_s() < 0.05
