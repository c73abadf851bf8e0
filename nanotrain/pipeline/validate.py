"""Check a schedule without any process group: well formed, finishes, and its messages cannot hang."""
from __future__ import annotations

from collections import Counter

from nanotrain.pipeline.comm_plan import Step, check_plan, plan
from nanotrain.pipeline.schedule import BEFORE, Schedule, ScheduleError
from nanotrain.pipeline.timeline import timeline


def check_actions(schedule: Schedule) -> None:
    """Every (stage, mb) has one F and either one B or one I and one W, on the stage's rank, in order."""
    if len(schedule.ranks) != schedule.n_ranks:
        raise ScheduleError(f"schedule {schedule.name!r} has {len(schedule.ranks)} action lists "
                            f"for {schedule.n_ranks} ranks")
    if schedule.n_stages % schedule.n_ranks:
        raise ScheduleError(f"{schedule.n_stages} stages do not spread evenly over {schedule.n_ranks} ranks")
    seen: Counter = Counter()
    for r, acts in enumerate(schedule.ranks):
        done: set[tuple[str, int, int]] = set()
        for a in acts:
            where = f"schedule {schedule.name!r}, rank {r}, action {a}"
            if not 0 <= a.stage < schedule.n_stages or schedule.rank_of(a.stage) != r:
                raise ScheduleError(f"{where}: stage {a.stage} belongs on rank {schedule.rank_of(a.stage)}")
            if not 0 <= a.mb < schedule.n_microbatches:
                raise ScheduleError(f"{where}: micro-batch {a.mb} is outside 0..{schedule.n_microbatches - 1}")
            if a.kind not in ("F", "B", "I", "W"):
                raise ScheduleError(f"{where}: unknown kind {a.kind!r} (known: F, B, I, W)")
            before = BEFORE[a.kind]
            if before and (before, a.stage, a.mb) not in done:
                raise ScheduleError(f"{where}: runs before {before}{a.mb}@s{a.stage} on the same rank")
            done.add((a.kind, a.stage, a.mb))
            seen[(a.kind, a.stage, a.mb)] += 1
    for stage in range(schedule.n_stages):
        for mb in range(schedule.n_microbatches):
            f, b, i, w = (seen[(k, stage, mb)] for k in "FBIW")
            if f != 1 or not ((b, i, w) == (1, 0, 0) or (b, i, w) == (0, 1, 1)):
                raise ScheduleError(f"schedule {schedule.name!r}: stage {stage}, micro-batch {mb} has {f} F, {b} B, "
                                    f"{i} I and {w} W; it needs one F and either one B or one I and one W")


def validate(schedule: Schedule) -> list[list[Step]]:
    """Raise ``ScheduleError`` naming the rank and action if ``schedule`` is wrong; return its comm plan."""
    check_actions(schedule)
    timeline(schedule)  # raises on an order that cannot finish
    plans = plan(schedule)
    check_plan(schedule, plans)
    return plans
