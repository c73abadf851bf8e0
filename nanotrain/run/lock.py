"""One run per run folder: a run holds ``OUT/.lock`` from its checks to its end, so a second run on the same
``--out`` cannot clean the first one's metrics or prune its checkpoints.

The lock is a small JSON file (the holder's pid, host, command and start), created in one step (``os.link`` of a
written file: it appears whole or not at all). A second run is refused in one line naming the holder. A lock left
by a run that is gone (killed by SIGKILL or the OOM killer: no code of its own ran) is taken over, said in one
line, when it names a process of this host that no longer runs; one from another host is the user's to judge (the
message names the file to delete). One process holds it for a run of many ranks: the launcher that starts them
here, or the first rank under torchrun. It is released at every exit of that process that runs code: the end, an
error, an exception, a signal that stops the run (the task ends by the signal after releasing it).
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from nanotrain.checkpoint.disk import check_writable
from nanotrain.data_parallel.launch import STARTED_HERE
from nanotrain.run.cli import fail
from weights import CheckpointError

LOCK = ".lock"


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    command: str
    since: str
    started: int | None  # the process's start time in clock ticks since boot (Linux), so a reused pid is not it

    @staticmethod
    def me() -> Holder:
        return Holder(os.getpid(), socket.gethostname(), shlex.join([Path(sys.argv[0]).name] + sys.argv[1:]),
                      time.strftime("%Y-%m-%d %H:%M:%S %Z"), _started(os.getpid()))

    def gone(self) -> bool:
        """Whether this holder is a process of this host that no longer runs (this one included: a pid reused)."""
        if self.host != socket.gethostname():
            return False
        if self.pid == os.getpid():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's process: it runs
            pass
        return self.started is not None and _started(self.pid) not in (None, self.started)

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} ({self.command}), since {self.since}"


def _started(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the command's parenthesised name


def holds_lock() -> bool:
    """Whether this process takes the lock for its run: not a rank a launcher here started, and the first rank."""
    return not os.environ.get(STARTED_HERE) and int(os.environ.get("RANK", 0)) == 0


@contextlib.contextmanager
def run_folder(out: Path) -> Iterator[None]:
    """``--out`` for this run: a folder it can write in (one line if not), held while this process holds the lock
    (``holds_lock``)."""
    try:
        check_writable(out)
    except CheckpointError as e:
        fail(str(e))
    with hold(out) if holds_lock() else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def hold(out: Path) -> Iterator[None]:
    """Hold ``out`` for this run (created if missing, removed again if the run leaves it empty)."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path, me = out / LOCK, Holder.me()
    try:
        _take(path, me)
        yield
    finally:
        with contextlib.suppress(OSError, ValueError, TypeError):
            if _read(path) == me:  # never another run's
                path.unlink()
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()  # only when empty: a run refused before it wrote anything leaves no folder


def _take(path: Path, me: Holder) -> None:
    mine = path.with_name(f"{LOCK}.{me.pid}")
    mine.write_text(json.dumps(asdict(me)) + "\n")
    try:
        for _ in range(2):
            try:
                os.link(mine, path)
                return
            except FileExistsError:
                pass
            try:
                holder = _read(path)
            except FileNotFoundError:
                continue  # released meanwhile
            except (OSError, ValueError, TypeError):
                fail(f"{path.parent} holds a lock file that is not one of nanotrain's ({path}): if no run uses the "
                     f"folder, delete it")
            if not holder.gone():
                fail(f"{path.parent} is in use by another run: {holder.describe()}; wait for it to end, pass another "
                     f"--out, or, if that run is gone, delete {path}")
            print(f"taking over {path} from a run that is gone: {holder.describe()}", flush=True)
            path.unlink(missing_ok=True)
        fail(f"{path.parent}: another run took {path} at the same moment; pass another --out")
    finally:
        mine.unlink(missing_ok=True)


def _read(path: Path) -> Holder:
    return Holder(**json.loads(path.read_text()))
