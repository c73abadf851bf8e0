"""Schedules as data: checked, simulated and printed without any process group."""
from __future__ import annotations

import pytest

from nanotrain.pipeline import (Action, Schedule, ScheduleError, bubble_fraction, build_schedule, format_grid, gpipe,
                                interleaved_1f1b, one_f_one_b, plan, validate, zb_h1)
from nanotrain.pipeline.comm_plan import Op, Step, check_plan
from nanotrain.pipeline.schedule import consumes
from nanotrain.pipeline.layered import split_balanced, split_by_counts


def all_schedules():
    for p in (1, 2, 3, 4, 8):
        for m in (1, 2, 3, 4, 8, 16):
            yield gpipe(p, m)
            yield one_f_one_b(p, m)
            yield zb_h1(p, m)
            if m % p == 0:
                for v in (1, 2, 3):
                    yield interleaved_1f1b(p, m, v)


def test_every_schedule_is_valid_and_cannot_hang():
    for s in all_schedules():
        validate(s)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 32), (8, 16)])
def test_bubbles_match_theory(p, m):
    assert bubble_fraction(gpipe(p, m)) == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_fraction(one_f_one_b(p, m)) == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_fraction(interleaved_1f1b(p, m, 2)) == pytest.approx((p - 1) / (2 * m + p - 1))
    assert bubble_fraction(zb_h1(p, m)) == pytest.approx((p - 1) / (3 * m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 8), (4, 16), (8, 32)])
@pytest.mark.parametrize("f,i,w", [(1, 1.6, 0.77), (1, 2, 0.5), (1, 1, 1.5), (1, 1.2, 1.0)])
def test_zb_h1_bubble_with_unequal_passes(p, m, f, i, w):
    """Qi et al.'s ZB-H1 bubble, (p-1)(F+I-W), once W is no longer than F; else (p-1)I.

    (p-1)I is a floor for any schedule that holds at most p micro-batches on the first stage, as
    1F1B does: its first I waits for a forward through every stage and p-1 I passes back, while
    it can only have run p forwards. With unequal passes the unit theory (p-1)/(3m+p-1) is below
    that floor; the bench compares against this formula at the measured durations.
    """
    idle = (p - 1) * max(f + i - w, i)
    assert bubble_fraction(zb_h1(p, m), {"F": f, "I": i, "W": w}) == pytest.approx(idle / (m * (f + i + w) + idle))


def in_flight(actions, freed_by: str) -> int:
    """Most micro-batches a rank holds between their F and their ``freed_by`` action."""
    held = peak = 0
    for a in actions:
        held += (a.kind == "F") - (a.kind == freed_by)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("m", [8, 1000])
def test_1f1b_and_zb_h1_hold_at_most_p_minus_r_activations(m):
    p = 4
    for r, acts in enumerate(one_f_one_b(p, m).ranks):
        assert in_flight(acts, "B") == p - r
    for r, acts in enumerate(zb_h1(p, m).ranks):
        # Rank r defers r W passes, but no rank holds W inputs for more than rank 0's 1F1B count.
        assert in_flight(acts, "I") <= p - r and in_flight(acts, "W") <= p
    assert in_flight(gpipe(p, m).ranks[0], "B") == m


def receive_leads(schedule: Schedule) -> list[int]:
    """For every receive, how many of its rank's actions run between its posting and its use."""
    leads = []
    for steps in plan(schedule):
        actions = [step.action for step in steps]
        for j, step in enumerate(steps):
            for op in (o for o in step.ops if not o.send):
                use = next(k for k in range(j, len(steps))
                           if actions[k] and consumes(actions[k], schedule.n_stages) == op.msg)
                leads.append(sum(1 for a in actions[j:use] if a))
    return leads


@pytest.mark.parametrize("p,m", [(2, 4), (4, 16), (8, 16)])
def test_receives_are_posted_just_before_their_action(p, m):
    # A posted NCCL receive holds SMs until its data comes: only crossing sends justify one early.
    for s in (gpipe(p, m), one_f_one_b(p, m), zb_h1(p, m)):
        assert max(receive_leads(s)) == 0, s.name
    for v in (2, 3):
        interleaved = interleaved_1f1b(p, m, v)
        assert max(receive_leads(interleaved)) == 1
        check_plan(interleaved, plan(interleaved))


def test_grid_prints_time_by_rank():
    grid = format_grid(one_f_one_b(2, 2))
    assert grid.splitlines()[1].split() == ["time", "rank0", "rank1"]
    assert grid.splitlines()[2].split() == ["0", "F0", "."]
    assert "bubble 33.3%" in grid
    assert "F1s2" in format_grid(interleaved_1f1b(2, 2, 2))


def schedule(*ranks, m=2, stages=2) -> Schedule:
    return Schedule("handmade", len(ranks), stages, m, tuple(tuple(Action(*a) for a in r) for r in ranks))


def test_validator_names_the_problem():
    ok0 = [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1)]
    ok1 = [(1, "F", 0), (1, "B", 0), (1, "F", 1), (1, "B", 1)]
    validate(schedule(ok0, ok1))
    with pytest.raises(ScheduleError, match="stage 1 belongs on rank 1"):
        validate(schedule(ok0 + [(1, "F", 0)], ok1))
    with pytest.raises(ScheduleError, match="stage 1, micro-batch 1 has 1 F, 0 B"):
        validate(schedule(ok0, ok1[:-1]))
    with pytest.raises(ScheduleError, match="runs before I0@s1"):
        validate(schedule(ok0, [(1, "F", 0), (1, "W", 0), (1, "I", 0), (1, "F", 1), (1, "B", 1)]))
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 at B0@s0 waits for B0@s1; rank 1 at F1@s1"):
        validate(schedule([(0, "F", 0), (0, "B", 0), (0, "F", 1), (0, "B", 1)],
                          [(1, "F", 0), (1, "F", 1), (1, "B", 0), (1, "B", 1)]))


def test_comm_check_catches_crossed_blocking_sends():
    """Two ranks that each send before receiving, in separate batches, hang on NCCL: caught offline."""
    s = one_f_one_b(2, 1)
    good = plan(s)
    check_plan(s, good)
    act = next(op for st in good[0] for op in st.ops)  # rank 0 -> 1: the activation
    grad = next(op for st in good[1] for op in st.ops if op.send)  # rank 1 -> 0: its gradient
    crossed = [[Step((act,), None), Step((Op(False, 1, grad.msg),), None)],
               [Step((grad,), None), Step((Op(False, 0, act.msg),), None)]]
    with pytest.raises(ScheduleError, match="deadlocks in its communication"):
        check_plan(s, crossed)


def test_unknown_names_and_bad_sizes_are_explained():
    with pytest.raises(ValueError, match="unknown schedule '1f1f'.*known: gpipe, 1f1b"):
        build_schedule("1f1f", 2, 4)
    with pytest.raises(ValueError, match="multiple of the rank count.*use 8 micro-batches"):
        interleaved_1f1b(4, 6)


def test_partitions():
    assert [len(r) for r in split_by_counts(8, [3, 2, 2, 1])] == [3, 2, 2, 1]
    with pytest.raises(ValueError, match=r"sum to the model's 8 layers, e.g. \[3, 3, 2\]"):
        split_by_counts(8, [3, 3, 3])
    assert [len(r) for r in split_balanced([1.0] * 8, 4)] == [2, 2, 2, 2]
    # An expensive head (GPT-2's vocabulary projection) leaves the last stage fewer blocks.
    assert [len(r) for r in split_balanced([1.0] * 10, 4, head_cost=2.0)] == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 stages"):
        split_balanced([1.0] * 3, 4)


def test_comm_check_catches_messages_received_out_of_order():
    s = one_f_one_b(2, 2)
    swapped = [list(steps) for steps in plan(s)]
    recvs = [j for j, st in enumerate(swapped[1]) if any(not op.send for op in st.ops)]
    a, b = recvs[0], recvs[1]  # rank 1 receives micro-batch 1's activation before micro-batch 0's
    swapped[1][a], swapped[1][b] = (Step(swapped[1][b].ops, swapped[1][a].action),
                                    Step(swapped[1][a].ops, swapped[1][b].action))
    with pytest.raises(ScheduleError, match="message 0 from rank 0 to rank 1 is act\\(stage 1, mb 0\\) but rank 1 "
                                            "receives act\\(stage 1, mb 1\\)"):
        check_plan(s, swapped)
