"""Pipeline schedules as data: for every rank, the ordered list of compute actions it runs.

An action is (stage, kind, micro-batch) with kind F (forward), B (full backward), I (backward
for the stage input only) or W (backward for the weights only). Which messages flow between
ranks follows from the actions (``consumes``, ``produces``; batched in ``comm_plan.py``); when
they run follows from their order (``timeline.py``). A new schedule is a new function returning
a ``Schedule``; nothing else changes. Stage ``s`` lives on rank ``s % n_ranks``, so with ``v``
stages per rank the model loops through the ranks ``v`` times (Megatron's interleaved layout).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

Kind = Literal["F", "B", "I", "W"]
# The action of the same stage and micro-batch that must run before each kind, on the same rank.
BEFORE: dict[str, str | None] = {"F": None, "B": "F", "I": "F", "W": "I"}


class ScheduleError(ValueError):
    """A schedule that is malformed or cannot run; the message says which rank and action."""


@dataclass(frozen=True)
class Action:
    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}@s{self.stage}"


@dataclass(frozen=True)
class Schedule:
    name: str
    n_ranks: int
    n_stages: int
    n_microbatches: int
    ranks: tuple[tuple[Action, ...], ...]

    def rank_of(self, stage: int) -> int:
        return stage % self.n_ranks

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.n_stages, self.n_ranks))

    def split_backwards(self) -> set[tuple[int, int]]:
        """The (stage, mb) pairs whose backward runs as I and W."""
        return {(a.stage, a.mb) for acts in self.ranks for a in acts if a.kind == "I"}


@dataclass(frozen=True)
class Message:
    kind: Literal["act", "grad"]
    stage: int  # the stage that consumes it
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}(stage {self.stage}, mb {self.mb})"

    @property
    def source(self) -> int:
        """The stage that sends it."""
        return self.stage - 1 if self.kind == "act" else self.stage + 1


def consumes(a: Action, n_stages: int) -> Message | None:
    """The message ``a`` needs from a neighbouring stage, if any."""
    if a.kind == "F" and a.stage > 0:
        return Message("act", a.stage, a.mb)
    if a.kind in "BI" and a.stage < n_stages - 1:
        return Message("grad", a.stage, a.mb)
    return None


def produces(a: Action, n_stages: int) -> Message | None:
    """The message ``a`` sends to a neighbouring stage, if any."""
    if a.kind == "F" and a.stage < n_stages - 1:
        return Message("act", a.stage + 1, a.mb)
    if a.kind in "BI" and a.stage > 0:
        return Message("grad", a.stage - 1, a.mb)
    return None


def _check_sizes(n_ranks: int, n_microbatches: int) -> None:
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")


def gpipe(n_ranks: int, n_microbatches: int) -> Schedule:
    """All forwards, then all backwards (Huang et al. 2019): every micro-batch's activations live at once."""
    _check_sizes(n_ranks, n_microbatches)
    m = range(n_microbatches)
    ranks = tuple(tuple([Action(r, "F", i) for i in m] + [Action(r, "B", i) for i in m]) for r in range(n_ranks))
    return Schedule("gpipe", n_ranks, n_ranks, n_microbatches, ranks)


def one_f_one_b(n_ranks: int, n_microbatches: int) -> Schedule:
    """PipeDream-Flush: rank r runs p-1-r warm-up forwards, then alternates one forward and one backward.

    Rank r never holds more than p - r micro-batches of activations, however many there are.
    """
    _check_sizes(n_ranks, n_microbatches)
    ranks = []
    for r in range(n_ranks):
        warmup = min(n_ranks - 1 - r, n_microbatches)
        acts = [Action(r, "F", i) for i in range(warmup)]
        for i in range(n_microbatches - warmup):
            acts += [Action(r, "F", warmup + i), Action(r, "B", i)]
        acts += [Action(r, "B", i) for i in range(n_microbatches - warmup, n_microbatches)]
        ranks.append(tuple(acts))
    return Schedule("1f1b", n_ranks, n_ranks, n_microbatches, tuple(ranks))


def interleaved_1f1b(n_ranks: int, n_microbatches: int, n_virtual: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): v model chunks per rank, bubble / v.

    Work is ordered in "virtual micro-batches": rank r runs chunk c on p micro-batches at a time,
    then moves to chunk c + 1, so each rank starts its next chunk as soon as the previous rank
    has fed it. Forwards go through chunks 0..v-1, backwards through v-1..0.
    """
    _check_sizes(n_ranks, n_microbatches)
    if n_virtual < 1:
        raise ValueError(f"n_virtual must be >= 1, got {n_virtual}")
    if n_microbatches % n_ranks:
        raise ValueError(f"interleaved 1F1B needs the micro-batch count ({n_microbatches}) to be a multiple of the "
                         f"rank count ({n_ranks}); use {n_ranks * -(-n_microbatches // n_ranks)} micro-batches")
    p, v, total = n_ranks, n_virtual, n_microbatches * n_virtual

    def chunk_and_mb(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (chunk if forward else v - 1 - chunk), (k // (p * v)) * p + k % p

    def act(r: int, k: int, kind: Kind) -> Action:
        chunk, mb = chunk_and_mb(k, kind == "F")
        return Action(chunk * p + r, kind, mb)

    ranks = []
    for r in range(p):
        # Enough forwards that the first backward of chunk v-1 has come back down to this rank.
        warmup = min((p - 1 - r) * 2 + (v - 1) * p, total)
        acts = [act(r, k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            acts += [act(r, warmup + k, "F"), act(r, k, "B")]
        acts += [act(r, k, "B") for k in range(total - warmup, total)]
        ranks.append(tuple(acts))
    return Schedule("interleaved-1f1b", p, p * v, n_microbatches, tuple(ranks))


def zb_h1(n_ranks: int, n_microbatches: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al. 2023): 1F1B with each backward split into I and W.

    Only I is on the critical path between ranks (a rank sends its input gradient as soon as I is
    done); W passes fill what would be bubbles. Rank r runs 1F1B's p-1-r warm-up forwards, then
    takes its first r backwards as I alone: those r W passes wait for the cool-down, where rank r
    would otherwise idle while gradients come back from the ranks after it. In between, each
    forward is followed by the next I and the oldest pending W.

    Memory: at most p - r micro-batches hold their activations (F done, I not), as in 1F1B, and
    at most p hold W's inputs (F done, W not), rank 0's 1F1B count, so the peak over ranks is
    1F1B's. With unit costs (F = I = W) the bubble is (p-1)/(3m+p-1), a third of 1F1B's.
    """
    _check_sizes(n_ranks, n_microbatches)
    ranks = tuple(_zb_h1_rank(r, n_ranks, n_microbatches) for r in range(n_ranks))
    return Schedule("zb-h1", n_ranks, n_ranks, n_microbatches, ranks)


def _zb_h1_rank(r: int, p: int, m: int) -> tuple[Action, ...]:
    acts: list[Action] = []
    count = {"F": 0, "I": 0, "W": 0}

    def run(*kinds: Kind) -> None:
        for kind in kinds:
            acts.append(Action(r, kind, count[kind]))
            count[kind] += 1

    for _ in range(min(p - 1 - r, m)):
        run("F")
    for _ in range(min(r, m - count["F"])):
        run("F", "I")
    while count["F"] < m:
        run("F", "I", "W")
    while count["I"] < m:
        run("I", "W")
    while count["W"] < m:
        run("W")
    return tuple(acts)


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
}


def build_schedule(name: str, n_ranks: int, n_microbatches: int, n_virtual: int = 2) -> Schedule:
    """A schedule by name; ``n_virtual`` (stages per rank) only applies to interleaved-1f1b."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r} (known: {', '.join(SCHEDULES)})")
    if name == "interleaved-1f1b":
        return interleaved_1f1b(n_ranks, n_microbatches, n_virtual)
    return SCHEDULES[name](n_ranks, n_microbatches)
