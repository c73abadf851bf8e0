"""Which tensors each rank sends and receives, in what batches, and a check that they cannot hang.

Every F of stage s < S-1 sends its output to stage s+1; every B or I of stage s > 0 sends the
gradient of its input to stage s-1. Sends and receives go out in ``batch_isend_irecv`` batches
placed by the schedule's unit-cost timeline (see ``plan``), so both ends of every pair of ranks
agree on the order of their messages: NCCL and gloo match messages between two ranks by order,
not by name, and activations and gradients of one micro-batch have the same shape.

``check_plan`` replays the plan under the strictest semantics either backend may have: a send
completes only when its receive is posted, and a rank's batches complete one after another (NCCL
runs them on one stream). A plan that passes cannot deadlock on gloo or NCCL.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

from nanotrain.pipeline.schedule import Action, Schedule
from nanotrain.pipeline.timeline import ScheduleError, timeline


@dataclass(frozen=True)
class Message:
    kind: Literal["act", "grad"]
    stage: int  # the stage that consumes it
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}(stage {self.stage}, mb {self.mb})"


@dataclass(frozen=True)
class Op:
    send: bool
    peer: int
    msg: Message

    def __str__(self) -> str:
        return f"{'send' if self.send else 'recv'} {self.msg} {'to' if self.send else 'from'} rank {self.peer}"


@dataclass(frozen=True)
class Step:
    ops: tuple[Op, ...]  # posted as one batch before the action
    action: Action | None  # None for the last batch of a rank: its remaining sends


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


def source_stage(msg: Message) -> int:
    return msg.stage - 1 if msg.kind == "act" else msg.stage + 1


def plan(schedule: Schedule) -> list[list[Step]]:
    """Each rank's steps: a batch of sends and receives, then (usually) one action.

    Every message is sent and received in batches stamped with the tick its producer ends in
    the unit-cost timeline. The stamps are one global order, so all batches of a tick match each
    other op for op, and a rank only waits for batches of ticks at or before its action: by
    induction over ticks no batch waits forever, even with NCCL's one-stream-per-peer semantics.
    """
    n = schedule.n_stages
    slots = timeline(schedule)
    batches: list[dict[int, list[Op]]] = [defaultdict(list) for _ in schedule.ranks]  # rank -> tick -> ops
    for r, rank_slots in enumerate(slots):
        for slot in rank_slots:
            msg = produces(slot.action, n)
            if msg is not None and schedule.rank_of(msg.stage) != r:
                dst = schedule.rank_of(msg.stage)
                batches[r][slot.end].append(Op(True, dst, msg))
                batches[dst][slot.end].append(Op(False, r, msg))
    plans = []
    for r, rank_slots in enumerate(slots):
        ticks = sorted(batches[r])
        steps, t = [], 0
        for slot in rank_slots:
            while t < len(ticks) and ticks[t] < slot.start:
                steps.append(Step(tuple(batches[r][ticks[t]]), None))
                t += 1
            at_start = t < len(ticks) and ticks[t] == slot.start
            steps.append(Step(tuple(batches[r][ticks[t]]) if at_start else (), slot.action))
            t += at_start
        steps += [Step(tuple(batches[r][tick]), None) for tick in ticks[t:]]
        plans.append(steps)
    return plans


def check_order(plans: list[list[Step]]) -> None:
    """Between two ranks, the receiver must post its receives in the order the sender sends."""
    sends: dict[tuple[int, int], list[Message]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for r, steps in enumerate(plans):
        for step in steps:
            for op in step.ops:
                (sends[(r, op.peer)] if op.send else recvs[(op.peer, r)]).append(op.msg)
    for src, dst in sorted(set(sends) | set(recvs)):
        sent, expected = sends[(src, dst)], recvs[(src, dst)]
        for i in range(max(len(sent), len(expected))):
            a = sent[i] if i < len(sent) else "nothing"
            b = expected[i] if i < len(expected) else "nothing"
            if a != b:
                raise ScheduleError(f"message {i} from rank {src} to rank {dst} is {a} but rank {dst} receives {b} "
                                    f"there; NCCL matches by order, so one would land in the other's buffer")


def check_plan(schedule: Schedule, plans: list[list[Step]]) -> None:
    """Replay ``plans`` with rendezvous sends and in-order batches; raise ``ScheduleError`` on a hang."""
    check_order(plans)
    n_ranks = len(plans)
    batch_of: list[dict[Message, int]] = [{} for _ in plans]  # rank -> received message -> its step
    for r, steps in enumerate(plans):
        for j, step in enumerate(steps):
            for op in step.ops:
                if not op.send:
                    batch_of[r][op.msg] = j
    host = [0] * n_ranks  # next step whose action has not run
    issued = [0] * n_ranks  # steps whose batch has been posted
    stream: list[list[int]] = [[] for _ in plans]  # posted, unfinished batches, oldest first
    open_ops: list[dict[int, set[Op]]] = [{} for _ in plans]
    finished: list[set[int]] = [set() for _ in plans]

    def waits_on(r: int, step: Step) -> list[int]:
        need = None if step.action is None else consumes(step.action, schedule.n_stages)
        return [batch_of[r][need]] if need in batch_of[r] else []

    while True:
        progress = False
        for r, steps in enumerate(plans):
            while host[r] < len(steps):
                j = host[r]
                if issued[r] <= j:
                    issued[r] = j + 1
                    if steps[j].ops:
                        stream[r].append(j)
                        open_ops[r][j] = set(steps[j].ops)
                    progress = True
                if not all(b in finished[r] for b in waits_on(r, steps[j])):
                    break
                host[r] += 1
                progress = True
        for r in range(n_ranks):
            if not stream[r]:
                continue
            head = stream[r][0]
            for op in list(open_ops[r][head]):
                peer = op.peer
                mirror = Op(not op.send, r, op.msg)
                if stream[peer] and mirror in open_ops[peer][stream[peer][0]]:
                    open_ops[r][head].discard(op)
                    open_ops[peer][stream[peer][0]].discard(mirror)
                    progress = True
        for q in range(n_ranks):
            while stream[q] and not open_ops[q][stream[q][0]]:
                finished[q].add(stream[q].pop(0))
                progress = True
        if all(host[r] == len(plans[r]) and not stream[r] for r in range(n_ranks)):
            return
        if not progress:
            stuck = []
            for r in range(n_ranks):
                if stream[r]:
                    ops = ", ".join(str(o) for o in sorted(open_ops[r][stream[r][0]], key=str))
                    where = plans[r][host[r]].action if host[r] < len(plans[r]) else "the end of the step"
                    stuck.append(f"rank {r} (before {where}) is blocked on [{ops}]")
            raise ScheduleError(f"schedule {schedule.name!r} deadlocks in its communication: " + "; ".join(stuck))
