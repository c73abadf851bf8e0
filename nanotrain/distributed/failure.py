"""One failing rank stops every rank, with an error naming the rank and what it was doing.

The first rank to fail writes its message into the rendezvous store (compare-and-set keeps the
first, not the echoes from peers that then lose their connection). Every rank runs a small
thread that polls that key and, when another rank has failed, prints the message and exits:
a rank stuck inside a NCCL or gloo wait cannot be interrupted any other way, and waiting for the
collective timeout would take minutes. Losing the store itself (rank 0 or the launcher died)
stops the rank the same way.

A rank that is killed (``kill -9``, the OOM killer) reports nothing. So the thread also beats:
it adds to its own counter in the store at every poll and reads everyone's; a rank whose counter
has not moved for ``dead_after_s`` is named as dead, written into the store as the failure, and
every rank stops. Under NCCL a killed peer raises nothing in the others (they wait in its
collectives), so each one's watch sees the heartbeat stop: the first to see it writes it down, and
all name that rank. A rank that stops for a failure waits two polls before it exits, so that the
others read the failure before the store, if it lives in that rank, is gone. The thread needs the
GIL only for microseconds, so a rank busy in long kernels or collectives still beats; keep
``dead_after_s`` well above the longest stretch a rank may hold the GIL (minutes of compilation
release it often; a single C call that holds it for a minute would not).

Each rank's phase (what ``failures_reported``'s ``where`` says it is doing: "setup", "step 12",
"saving step 12"; the training loop keeps it current) goes into the store with its beat when it
changes, so a rank that is killed is named with what it was last doing, not only the survivors.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch.distributed as dist

FAILURE_KEY = "nanotrain/failure"
BEAT_KEY = "nanotrain/beat/{}"
WHERE_KEY = "nanotrain/where/{}"  # a rank's phase, as its watch last published it
DONE = b"-1"  # a rank that left cleanly


class RankFailure(RuntimeError):
    """Raised on the rank that failed, and on a rank that stopped because another one did."""


class RankLost(RankFailure):
    """Raised on a rank whose work failed because a peer was lost (killed, or hung): its own traceback says
    nothing about why, the message does."""


class FailureWatch:
    def __init__(self, store: dist.Store, rank: int, world_size: int, poll_s: float = 0.5,
                 dead_after_s: float = 60.0):
        self.store, self.rank, self.world_size, self.poll_s = store, rank, world_size, poll_s
        self.dead_after_s = dead_after_s
        self._beats: dict[int, tuple[bytes, float]] = {}  # rank -> (last counter seen, when it changed)
        self._stop = threading.Event()
        self._reported = False
        self.where: Callable[[], str] = lambda: "setup"  # this rank's phase (set by ``failures_reported``)
        self._published: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"failure-watch-{rank}", daemon=True)

    def start(self) -> "FailureWatch":
        self._started = time.monotonic()
        # The first beat now, not a poll later: a rank killed in its first poll_s has started, and is named dead.
        self.store.add(BEAT_KEY.format(self.rank), 1)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.store.set(BEAT_KEY.format(self.rank), DONE)
        except Exception:  # the store left with rank 0; nobody is left to watch us either
            pass

    def report(self, message: str) -> str:
        """Record ``message`` unless another rank failed first; return the failure that stands."""
        self._reported = True
        self._stop.set()  # nothing left to watch for; and polling a store that is going away only logs noise
        try:
            return self.store.compare_set(FAILURE_KEY, "", message).decode()
        except Exception:  # the store is gone with the rank that hosted it; keep our own message
            return message

    def doing(self, rank: int) -> str:
        """``, last seen in <phase>``: what ``rank`` last published it was doing (up to a poll late: it may
        have gone on since); '' if it never did, or the store is gone."""
        try:
            key = WHERE_KEY.format(rank)
            return f", last seen in {self.store.get(key).decode()}" if self.store.check([key]) else ""
        except Exception:  # the store left with rank 0
            return ""

    def _dead_rank(self) -> str:
        """A message naming a rank whose heartbeat stopped, or ''; beats this rank's own counter (and
        publishes its phase when it changed)."""
        self.store.add(BEAT_KEY.format(self.rank), 1)
        phase = self.where()
        if phase != self._published:
            self.store.set(WHERE_KEY.format(self.rank), phase)
            self._published = phase
        others = [r for r in range(self.world_size) if r != self.rank]
        keys = [BEAT_KEY.format(r) for r in others]
        now = time.monotonic()
        if not self.store.check(keys):  # multi_get would wait for a rank that has not beaten yet
            if now - self._started < self.dead_after_s:
                return ""
            missing = [r for r, k in zip(others, keys) if not self.store.check([k])]
            return f"rank {missing[0]} never started (no heartbeat {now - self._started:.0f} s after this one)"
        values = self.store.multi_get(keys)
        for r, value in zip(others, values):
            seen, since = self._beats.get(r, (None, now))
            if value != seen:
                self._beats[r] = (value, now)
            elif value != DONE and now - since > self.dead_after_s:
                return (f"rank {r} stopped responding (no heartbeat for {now - since:.0f} s: killed, or "
                        f"hung{self.doing(r)})")
        return ""

    def silent_ranks(self, wait_s: float) -> list[int]:
        """Ranks whose heartbeat does not move for ``wait_s`` (a few polls): dead, most likely.

        Asked when this rank's own work failed, since a lost peer often shows up as an error here
        (gloo: "connection closed by peer") before its heartbeat has been missing for long.
        """
        keys = [BEAT_KEY.format(r) for r in range(self.world_size)]
        try:
            before = [self.store.get(k) if self.store.check([k]) else b"0" for k in keys]
            time.sleep(wait_s)
            after = [self.store.get(k) if self.store.check([k]) else b"0" for k in keys]
        except Exception:  # the store is gone: rank 0 is the silent one
            return [0]
        return [r for r, (a, b) in enumerate(zip(before, after)) if a == b and b != DONE and r != self.rank]

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                failed = self.store.check([FAILURE_KEY])
                message = self.store.get(FAILURE_KEY).decode() if failed else self._dead_rank()
                if message and not failed:  # a dead rank seen here first: recorded for all, as report() does
                    message = self.store.compare_set(FAILURE_KEY, "", message).decode()
                failed = failed or bool(message)
            except Exception as e:
                if self._stop.is_set() or self._reported:
                    return
                message = f"lost the rendezvous store ({type(e).__name__}: {e}); rank 0 or the launcher has died"
                failed = True
            if failed and not self._reported:
                print(f"[rank {self.rank}] stopping because {message}", file=sys.stderr, flush=True)
                # The store may live in this process (rank 0): leaving at once would make the ranks that
                # have not read the failure yet blame rank 0 for the lost store.
                time.sleep(2 * self.poll_s)
                os._exit(1)


@contextmanager
def failures_reported(watch: FailureWatch, where: Callable[[], str]) -> Iterator[None]:
    """Turn any exception into a ``RankFailure`` naming this rank and ``where()`` it happened."""
    watch.where = where  # the watch publishes it, so that the others can name what this rank was doing
    try:
        yield
    except RankFailure:
        raise  # already reported by an inner guard
    except BaseException as e:
        mine = f"rank {watch.rank} failed during {where()}: {type(e).__name__}: {e}"
        silent = watch.silent_ranks(3 * watch.poll_s) if isinstance(e, (RuntimeError, OSError)) else []
        if silent:
            mine = (f"rank {silent[0]} stopped responding (no heartbeat: killed?{watch.doing(silent[0])}); rank "
                    f"{watch.rank} lost it during {where()}: {type(e).__name__}: {e}")
        first = watch.report(mine)
        # The store may live in this process (rank 0): give the others a moment to read it.
        time.sleep(2 * watch.poll_s)
        stand = mine if first in ("", mine) else f"rank {watch.rank} stopped during {where()} because {first}"
        raise (RankLost if silent else RankFailure)(stand) from e
