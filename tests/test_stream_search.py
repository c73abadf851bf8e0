"""The streaming planner's search (``nanotrain.memory.stream_search``): every plan it ranks fits both
caps, flags given by hand stay fixed, the ranking follows the step-time model, and a cap that nothing
fits is refused with the closest plan named. Arithmetic only: no GPU."""
from __future__ import annotations

import pytest

from nanotrain.models import preset
from nanotrain.memory.plan import GIB, _CAP_HEADROOM
from nanotrain.memory.stream_search import StreamCosts, format_ranked, predict, search_streaming

LARGE = preset("gpt2-large")
FAST_LINK = StreamCosts(link_bytes_s=50e9)


def test_every_ranked_plan_fits_both_caps_and_the_fastest_comes_first():
    ranked = search_streaming(LARGE, 64, 1024, 11 * GIB, 16 * GIB, 32, FAST_LINK, base_rss=2 * GIB)
    assert len(ranked) > 100
    assert all(r.plan.device_bytes <= _CAP_HEADROOM * 11 * GIB and r.plan.host_bytes <= 16 * GIB for r in ranked)
    assert [r.step_s for r in ranked] == sorted(r.step_s for r in ranked)
    pick = ranked[0]
    # gpt2-large under 11 GiB: a tail (no recompute for its blocks) beats none, at the largest micro-batch
    assert pick.tail > 0 and pick.plan.micro_batch == 16
    no_tail = min(r.step_s for r in ranked if r.tail == 0)
    assert pick.step_s < no_tail
    table = format_ranked(ranked, 64, rows=3)
    assert len(table.splitlines()) == 5 and f"({len(ranked)} plans fit)" in table


def test_given_flags_stay_fixed():
    ranked = search_streaming(LARGE, 64, 1024, 11 * GIB, 16 * GIB, 32, FAST_LINK, micro_batch=8, tail_mb=4,
                              base_rss=2 * GIB)
    assert {r.plan.micro_batch for r in ranked} == {8}
    assert {r.tail_micro_batch for r in ranked if r.tail} == {4}
    fixed = search_streaming(LARGE, 64, 1024, 11 * GIB, 16 * GIB, 32, FAST_LINK, tail=16, base_rss=2 * GIB)
    assert {r.tail for r in fixed} == {16}


def test_the_model_charges_recompute_small_passes_and_a_slow_link():
    ranked = search_streaming(LARGE, 64, 1024, 11 * GIB, 16 * GIB, 32, FAST_LINK, micro_batch=16, base_rss=2 * GIB)
    by = {(r.tail, r.tail_micro_batch): r for r in ranked}
    plan = by[(8, 8)].plan
    # with the same plan, passes of 4 sequences cost more than passes of 8 (twice the fixed per-pass costs)
    assert predict(LARGE, 64, 1024, plan, 8, 4, 32, FAST_LINK).step_s > by[(8, 8)].step_s
    # a link too slow for the masters and moments makes the backward wait for it
    slow = predict(LARGE, 64, 1024, plan, 8, 8, 32, StreamCosts(link_bytes_s=5e9))
    assert slow.link_bound and not by[(8, 8)].link_bound and slow.step_s > by[(8, 8)].step_s


def test_nothing_fits_names_the_closest_plan():
    with pytest.raises(MemoryError, match="closest plan needs micro-batch 1"):
        search_streaming(preset("gpt2-xl"), 64, 1024, 11 * GIB, 8 * GIB, 32, FAST_LINK)
