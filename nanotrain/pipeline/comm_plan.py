"""Which tensors each rank sends and receives, in what batches, and a check that they cannot hang.

A rank posts each message an action produces (``schedule.produces``) right after the action and
each receive right before the action that needs it, in one ``batch_isend_irecv`` per action.
Receiving any earlier costs compute: a posted NCCL receive is a kernel that occupies SMs until
its data arrives (receives posted one action early made gpt2-xl's first-stage forwards 16%
slower on average, 30% at worst). NCCL and gloo match the messages between two ranks by order,
not by name, so a receiver takes a sender's messages in the order they were sent, posting an
earlier one with the one it needs.

``check_plan`` replays the plan under the strictest semantics either backend may have: a send
completes only when its receive is posted, and a rank's batches complete one after another (NCCL
runs them on one stream). A plan that passes cannot deadlock on gloo or NCCL.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from nanotrain.pipeline.schedule import Action, Message, Schedule, ScheduleError, consumes, produces


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


def plan(schedule: Schedule) -> list[list[Step]]:
    """Each rank's steps: a batch of sends and receives, then (usually) one action.

    A step's batch holds the sends of the rank's previous action and the receive its own action
    needs, preceded by any message the same sender sent before that one and this rank consumes
    later. The last step of a rank, with no action, posts the sends of its last action.

    Two ranks that send to each other at once would each wait for the other's receive (with
    several stages per rank, interleaved 1F1B does). Where the replay finds that, the blocked
    sends' receives move into the batch their rank is blocked on, and the plan is replayed again.
    """
    plans = _just_in_time(schedule)
    while (stuck := _replay(schedule, plans)) is not None and _receive_earlier(plans, stuck):
        pass
    return plans


def _receive_earlier(plans: list[list[Step]], stuck: _Stuck) -> bool:
    """Move the receives of blocked sends into the batch their receiver is blocked on; False if none can move.

    A receiver takes a sender's messages in order, so the receives before the moved one go too.
    """
    moved = False
    for r in stuck.heads:
        for op in (o for o in stuck.open_ops[r] if o.send and o.peer in stuck.heads):
            peer, target = op.peer, stuck.heads[op.peer]
            steps = plans[peer]
            where = next(j for j, step in enumerate(steps) if Op(False, r, op.msg) in step.ops)
            if where <= target:
                continue
            take: list[Op] = []
            for j in range(target + 1, where + 1):
                mine = [o for o in steps[j].ops if not o.send and o.peer == r]
                if j == where:
                    mine = mine[:mine.index(Op(False, r, op.msg)) + 1]
                take += mine
                steps[j] = Step(tuple(o for o in steps[j].ops if o not in mine), steps[j].action)
            steps[target] = Step(steps[target].ops + tuple(take), steps[target].action)
            moved = True
    return moved


def _just_in_time(schedule: Schedule) -> list[list[Step]]:
    """Sends after their action, receives before theirs (with the sender's earlier messages)."""
    n = schedule.n_stages
    sent: dict[tuple[int, int], list[Message]] = defaultdict(list)  # (sender, receiver) -> in send order
    for r, acts in enumerate(schedule.ranks):
        for a in acts:
            msg = produces(a, n)
            if msg is not None and schedule.rank_of(msg.stage) != r:
                sent[(r, schedule.rank_of(msg.stage))].append(msg)
    plans = []
    for r, acts in enumerate(schedule.ranks):
        posted: dict[int, int] = defaultdict(int)  # sender -> how many of its messages are received
        steps, outgoing = [], []
        for a in acts:
            ops = outgoing
            need = consumes(a, n)
            src = None if need is None else schedule.rank_of(need.source)
            if src is not None and src != r:
                queue = sent[(src, r)]
                upto = queue.index(need) + 1
                ops = ops + [Op(False, src, msg) for msg in queue[posted[src]:upto]]
                posted[src] = max(posted[src], upto)
            steps.append(Step(tuple(ops), a))
            msg = produces(a, n)
            outgoing = [Op(True, schedule.rank_of(msg.stage), msg)] if msg and schedule.rank_of(msg.stage) != r else []
        if outgoing:
            steps.append(Step(tuple(outgoing), None))
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
    stuck = _replay(schedule, plans)
    if stuck is not None:
        blocked = [f"rank {r} (before {stuck.where[r]}) is blocked on "
                   f"[{', '.join(str(o) for o in sorted(stuck.open_ops[r], key=str))}]" for r in sorted(stuck.heads)]
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks in its communication: " + "; ".join(blocked))


@dataclass
class _Stuck:
    heads: dict[int, int]  # rank -> the step of its oldest unfinished batch
    open_ops: dict[int, set[Op]]  # rank -> that batch's unmatched sends and receives
    where: dict[int, object]  # rank -> the action its host waits to run


def _replay(schedule: Schedule, plans: list[list[Step]]) -> _Stuck | None:
    """Run ``plans`` on paper; None if every batch completes, else where each rank is blocked."""
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
            return None
        if not progress:
            heads = {r: stream[r][0] for r in range(n_ranks) if stream[r]}
            return _Stuck(heads, {r: open_ops[r][j] for r, j in heads.items()},
                          {r: plans[r][host[r]].action if host[r] < len(plans[r]) else "the end of the step"
                           for r in heads})
