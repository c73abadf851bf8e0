"""The streaming planner's search (``nanotrain.stream.search``): every plan it ranks fits both
caps, flags given by hand stay fixed, the ranking follows the step-time model, and a cap that nothing
fits is refused with the smallest caps that work. Arithmetic only: no GPU."""
from __future__ import annotations

from dataclasses import replace

import pytest

from nanotrain.core.models import preset
from nanotrain.core.footprint import margin
from nanotrain.core.machine import GIB
from nanotrain.stream.footprint import StreamJob
from nanotrain.stream.search import StreamCosts, predict, search_streaming

LARGE = StreamJob(preset("gpt2-large"), 64, 1024, 32, base_rss=2 * GIB)
FAST_LINK = StreamCosts(link_bytes_s=50e9)


def test_every_ranked_plan_fits_both_caps_and_the_fastest_comes_first():
    ranked = search_streaming(LARGE, 11 * GIB, 16 * GIB, FAST_LINK)
    assert len(ranked) > 100
    assert all(r.plan.device_bytes + margin(11 * GIB, True) <= 11 * GIB and r.plan.host_bytes <= 16 * GIB
               for r in ranked)
    assert [r.step_s for r in ranked] == sorted(r.step_s for r in ranked)
    pick = ranked[0]
    # gpt2-large under 11 GiB: a tail (no recompute for its blocks) beats none, at the largest micro-batch
    assert pick.plan.choice.tail > 0 and pick.plan.micro_batch == 16
    no_tail = min(r.step_s for r in ranked if r.plan.choice.tail == 0)
    assert pick.step_s < no_tail


def test_given_flags_stay_fixed():
    ranked = search_streaming(LARGE, 11 * GIB, 16 * GIB, FAST_LINK, micro_batch=8, tail_mb=4)
    assert {r.plan.micro_batch for r in ranked} == {8}
    assert {r.plan.choice.tail_micro_batch for r in ranked if r.plan.choice.tail} == {4}
    fixed = search_streaming(LARGE, 11 * GIB, 16 * GIB, FAST_LINK, tail=16, staged=False)
    assert {r.plan.choice.tail for r in fixed} == {16} and not any(r.plan.choice.staged_ends for r in fixed)


def test_the_model_charges_recompute_small_passes_a_slow_link_and_staging():
    ranked = search_streaming(LARGE, 11 * GIB, 16 * GIB, FAST_LINK, micro_batch=16, staged=False)
    by = {(r.plan.choice.tail, r.plan.choice.tail_micro_batch): r for r in ranked}
    plan = by[(8, 8)].plan
    # with the same plan, passes of 4 sequences cost more than passes of 8 (twice the fixed per-pass costs)
    assert predict(replace(plan, choice=replace(plan.choice, tail_micro_batch=4)), FAST_LINK).step_s > by[(8, 8)].step_s
    # a link too slow for the masters and moments makes the backward wait for it
    slow = predict(plan, StreamCosts(link_bytes_s=5e9))
    assert slow.link_bound and not by[(8, 8)].link_bound and slow.step_s > by[(8, 8)].step_s
    # staging the embedding sends its masters and moments both ways after the backward
    staged = predict(replace(plan, choice=replace(plan.choice, staged_ends=True)), FAST_LINK)
    assert staged.end_s == pytest.approx(LARGE.state(LARGE.spec.embed_unit) / 50e9)
    assert staged.step_s > by[(8, 8)].step_s


def test_nothing_fits_names_the_smallest_caps():
    with pytest.raises(MemoryError, match=r"no streaming plan fits a 11.0 GiB GPU cap and a 8.0 GiB host cap .* the "
                                          r"smallest caps that work are --host-mem-gib \d+\.\d with this GPU cap "
                                          r"\(or --adam-bits 8\)"):
        search_streaming(StreamJob(preset("gpt2-xl"), 64, 1024, 32), 11 * GIB, 8 * GIB, FAST_LINK)
