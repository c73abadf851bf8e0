"""Run a schedule on paper: when would each action start if F, B, I and W took fixed times?

This is both a check (an order that cannot finish is a deadlock, reported with what every rank
waits for) and the schedule's theory: its grid and its bubble fraction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from nanotrain.pipeline.schedule import BEFORE, Action, Schedule, ScheduleError, consumes

# Relative costs: a backward is two forward-sized matmuls (input and weight gradients).
UNIT_COSTS = {"F": 1, "B": 2, "I": 1, "W": 1}
# Per kind, or per action (e.g. measured durations of each stage's F and B).
Costs = Union[dict[str, float], Callable[[Action], float]]


def dependencies(a: Action, n_stages: int, split: set[tuple[int, int]]) -> list[Action]:
    """Actions, on any rank, that must finish before ``a`` can start: the one before it on its stage and the one
    that sends what it consumes. ``split`` holds the (stage, mb) pairs whose backward is split into I and W."""
    deps = [Action(a.stage, BEFORE[a.kind], a.mb)] if BEFORE[a.kind] else []
    msg = consumes(a, n_stages)
    if msg is not None:
        sender = "F" if msg.kind == "act" else "I" if (msg.source, a.mb) in split else "B"
        deps.append(Action(msg.source, sender, a.mb))
    return deps


@dataclass(frozen=True)
class Slot:
    start: float
    end: float
    action: Action


def timeline(schedule: Schedule, costs: Costs | None = None) -> list[list[Slot]]:
    """Start and end time of every action when each rank runs its list in order, as early as it can."""
    costs = costs or UNIT_COSTS
    cost = costs if callable(costs) else (lambda a: costs[a.kind])
    split = schedule.split_backwards()
    finished: dict[Action, float] = {}
    slots: list[list[Slot]] = [[] for _ in schedule.ranks]
    pos, free = [0] * schedule.n_ranks, [0.0] * schedule.n_ranks
    while True:
        progress = False
        for r, acts in enumerate(schedule.ranks):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                deps = dependencies(a, schedule.n_stages, split)
                if any(d not in finished for d in deps):
                    break
                start = max([free[r]] + [finished[d] for d in deps])
                free[r] = finished[a] = start + cost(a)
                slots[r].append(Slot(start, free[r], a))
                pos[r] += 1
                progress = True
        if all(pos[r] == len(acts) for r, acts in enumerate(schedule.ranks)):
            return slots
        if not progress:
            stuck = []
            for r, acts in enumerate(schedule.ranks):
                if pos[r] < len(acts):
                    a = acts[pos[r]]
                    missing = [str(d) for d in dependencies(a, schedule.n_stages, split) if d not in finished]
                    stuck.append(f"rank {r} at {a} waits for {', '.join(missing)}")
            raise ScheduleError(f"schedule {schedule.name!r} deadlocks: " + "; ".join(stuck))


def makespan(schedule: Schedule, costs: Costs | None = None) -> float:
    """When the timeline's last action ends: the step time of an engine whose messages are free."""
    return max(s.end for rank in timeline(schedule, costs) for s in rank)


def bubble_fraction(schedule: Schedule, costs: Costs | None = None) -> float:
    """Idle share of (ranks x makespan) in the timeline (unit costs unless given)."""
    slots = timeline(schedule, costs)
    end = max(s.end for rank in slots for s in rank)
    busy = sum(s.end - s.start for rank in slots for s in rank)
    return 1.0 - busy / (end * schedule.n_ranks)


def format_grid(schedule: Schedule, costs: dict[str, int] | None = None) -> str:
    """The unit-cost timeline as text, one row per time step and one column per rank.

    A cell is kind, micro-batch and (with several stages per rank) the stage, e.g. ``F3`` or
    ``B3s5``; a backward of cost 2 fills two rows; ``.`` is idle. Costs are whole time steps.
    """
    slots = timeline(schedule, costs)
    n_steps = int(max(s.end for rank in slots for s in rank))
    many = schedule.n_stages > schedule.n_ranks
    grid = [["."] * schedule.n_ranks for _ in range(n_steps)]
    for r, rank in enumerate(slots):
        for s in rank:
            label = f"{s.action.kind}{s.action.mb}" + (f"s{s.action.stage}" if many else "")
            for t in range(int(s.start), int(s.end)):
                grid[t][r] = label
    width = max(6, max(len(c) for row in grid for c in row) + 1)
    lines = [f"{schedule.name}: {schedule.n_ranks} ranks, {schedule.n_stages} stages, "
             f"{schedule.n_microbatches} micro-batches, bubble {bubble_fraction(schedule, costs):.1%}",
             "time " + "".join(f"rank{r}".ljust(width) for r in range(schedule.n_ranks))]
    lines += [f"{t:<5d}" + "".join(c.ljust(width) for c in row) for t, row in enumerate(grid)]
    return "\n".join(lines)
