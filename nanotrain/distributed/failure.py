"""One failing rank stops every rank, with an error naming the rank and what it was doing.

The first rank to fail writes its message into the rendezvous store (compare-and-set keeps the
first, not the echoes from peers that then lose their connection). Every rank runs a small
thread that polls that key and, when another rank has failed, prints the message and exits:
a rank stuck inside a NCCL or gloo wait cannot be interrupted any other way, and waiting for the
collective timeout would take minutes. Losing the store itself (rank 0 or the launcher died)
stops the rank the same way.
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


class RankFailure(RuntimeError):
    """Raised on the rank that failed, and on a rank that stopped because another one did."""


class FailureWatch:
    def __init__(self, store: dist.Store, rank: int, poll_s: float = 0.5):
        self.store, self.rank, self.poll_s = store, rank, poll_s
        self._stop = threading.Event()
        self._reported = False
        self._thread = threading.Thread(target=self._run, name=f"failure-watch-{rank}", daemon=True)

    def start(self) -> "FailureWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, message: str) -> str:
        """Record ``message`` unless another rank failed first; return the failure that stands."""
        self._reported = True
        self._stop.set()  # nothing left to watch for; and polling a store that is going away only logs noise
        try:
            return self.store.compare_set(FAILURE_KEY, "", message).decode()
        except Exception:  # the store is gone with the rank that hosted it; keep our own message
            return message

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                failed = self.store.check([FAILURE_KEY])
                message = self.store.get(FAILURE_KEY).decode() if failed else ""
            except Exception as e:
                if self._stop.is_set() or self._reported:
                    return
                message = f"lost the rendezvous store ({type(e).__name__}: {e}); rank 0 or the launcher has died"
                failed = True
            if failed and not self._reported:
                print(f"[rank {self.rank}] stopping because {message}", file=sys.stderr, flush=True)
                os._exit(1)


@contextmanager
def failures_reported(watch: FailureWatch, where: Callable[[], str]) -> Iterator[None]:
    """Turn any exception into a ``RankFailure`` naming this rank and ``where()`` it happened."""
    try:
        yield
    except RankFailure:
        raise  # already reported by an inner guard
    except BaseException as e:
        mine = f"rank {watch.rank} failed during {where()}: {type(e).__name__}: {e}"
        first = watch.report(mine)
        # The store may live in this process (rank 0): give the others a moment to read it.
        time.sleep(2 * watch.poll_s)
        raise RankFailure(mine if first in ("", mine) else f"rank {watch.rank} stopped during {where()} "
                              f"because {first}") from e
