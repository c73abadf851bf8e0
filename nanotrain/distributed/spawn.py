"""Run a function on N local processes that form a process group, as torchrun would.

The one spawner of nanotrain, used by the tests and by the tasks run without torchrun. Each process
gets torchrun's variables, runs ``fn(*args)`` (which joins the group with ``init_distributed``, as
it would under torchrun) and hands back its return value; if any process fails or the time runs
out, every process is stopped and the error shows each rank's output.

Signals, as torchrun handles them: each process runs in its own process group, so a Ctrl-C at the
terminal or a SIGTERM to the launcher's group (``kill``, ``timeout``, systemd, a container stop)
reaches the launcher only, which passes it on to every process once and waits for them (a task
saves at the step boundary, then ends by that signal; a second signal is passed on too, a third
kills them). A process whose launcher dies, even by SIGKILL, gets one SIGTERM (the kernel's
``PR_SET_PDEATHSIG``, once however many times it comes; elsewhere than Linux a thread watches its
parent), so none is left orphaned.
Processes that all end by SIGINT or SIGTERM, or exit 0, were stopped, not failed: ``Stopped``.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.multiprocessing as mp

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_DIED = signal.SIGHUP  # what the kernel sends a rank whose launcher died (a hang-up); see _die_with


class SpawnError(RuntimeError):
    def __init__(self, message: str, exit_codes: list, logs: str):
        super().__init__(message)
        self.exit_codes, self.logs = exit_codes, logs


class Stopped(SpawnError):
    """Every process ended by SIGINT or SIGTERM (a task stopped at a step boundary, saved) or finished."""

    def __init__(self, signum: int, exit_codes: list):
        super().__init__(f"stopped by {signal.Signals(signum).name}; exit codes {exit_codes}", exit_codes, "")
        self.signal = signum


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with(parent: int) -> None:
    """Get one SIGTERM when the launcher ``parent`` dies, however it dies.

    The kernel sends the death signal each time this process is handed from one of the dying launcher's
    threads to the next, so it can come several times; a second SIGTERM would read as "exit at once,
    unsaved". So the kernel sends ``PARENT_DIED``, and its handler turns the first one into a SIGTERM."""
    told = []

    def tell(signum: int, frame) -> None:
        if not told:
            told.append(signum)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(PARENT_DIED, tell)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, PARENT_DIED)
    except (AttributeError, OSError):  # not Linux: watch the parent instead

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os.kill(os.getpid(), PARENT_DIED)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if os.getppid() != parent:  # it died before the request was in place
        os.kill(os.getpid(), PARENT_DIED)


def _child(rank: int, world: int, port: int, out: str, capture: bool, threads: int, parent: int, fn: Callable,
           args: tuple) -> None:
    os.setpgid(0, 0)  # signals at the terminal or to the launcher's group reach the launcher only, which passes them on
    for sig in STOP_SIGNALS:  # a forked child inherits the launcher's handlers; the task installs its own
        signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
    _die_with(parent)
    # Local ranks share the machine's cores; more threads than cores make CPU runs crawl.
    torch.set_num_threads(threads)
    if capture:  # at the file-descriptor level, so C++ and the failure watch are captured too
        fd = os.open(f"{out}/rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        # A forked child inherits the parent's Python streams (pytest replaces them): rebind.
        sys.stdout, sys.stderr = open(1, "w", buffering=1, closefd=False), open(2, "w", buffering=1, closefd=False)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        result = fn(*args)
    except SystemExit as e:  # the task's own exit, its message already printed or carried: no traceback
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr, flush=True)
        raise SystemExit(e.code if isinstance(e.code, int) and e.code else 1) from None
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1) from None
    torch.save(result, f"{out}/rank{rank}.pt")


@contextmanager
def _passing_on(procs: list) -> Iterator[list[int]]:
    """While the processes run, pass each SIGINT and SIGTERM this process gets on to them (the third one on
    kills them); yields the signals received. Only the main thread can take signals: elsewhere, nothing."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handle(signum: int, frame) -> None:
        received.append(signum)
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL if len(received) > 2 else signum)

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stopped_by(code: int | None) -> bool:
    return code is not None and -code in STOP_SIGNALS


def spawn(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 300.0, capture: bool = True,
          start_method: str = "spawn", grace_s: float = 10.0) -> list[Any]:
    """``[fn(*args) on rank r for r in range(world_size)]``; ``fn`` must be importable (module level).

    With ``capture`` each rank's stdout and stderr go to a file that is shown only on failure.
    ``start_method="fork"`` skips importing torch again in every process (seconds each on a small
    CPU machine: the tests use it); keep "spawn" once CUDA has been touched. Each process gets its
    share of the cores as torch threads. ``grace_s``: how long the other processes get to stop by
    themselves (their failure watch) once one has failed, before they are killed.
    Raises ``Stopped`` when the processes ended by a signal (passed on from here, or sent to them).
    """
    threads = max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context(start_method)
    with tempfile.TemporaryDirectory(prefix="nanotrain-spawn-") as out:
        port = free_port()
        procs = [ctx.Process(target=_child, args=(r, world_size, port, out, capture, threads, os.getpid(), fn, args))
                 for r in range(world_size)]
        with _passing_on(procs) as received:
            for p in procs:
                p.start()
                try:  # here too, so that no signal falls between the fork and the child's own setpgid
                    os.setpgid(p.pid, p.pid)
                except OSError:  # the child did it first (or, with "spawn", has already exec'd)
                    pass
            deadline, failed = time.monotonic() + timeout_s, False
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                if any(p.exitcode not in (None, 0) and not _stopped_by(p.exitcode) for p in procs):
                    failed = True  # the others should stop by themselves (failure watch); give them a moment
                    grace = time.monotonic() + grace_s
                    while any(p.is_alive() for p in procs) and time.monotonic() < grace:
                        time.sleep(0.05)
                    break
                time.sleep(0.05)
            timed_out = not failed and any(p.is_alive() for p in procs)
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        codes = [p.exitcode for p in procs]
        stops = [-c for c in codes if _stopped_by(c)]
        if stops and not timed_out and all(c == 0 or _stopped_by(c) for c in codes):
            raise Stopped(stops[0], codes)
        if timed_out or any(codes):
            logs = "".join(f"\n--- rank {r} (exit code {codes[r]}) ---\n{_read(Path(out, f'rank{r}.log'))}"
                           for r in range(world_size)) if capture else ""
            what = f"timed out after {timeout_s:.0f} s" if timed_out else "failed"
            if received:
                what += f" after {signal.Signals(received[0]).name} was passed on to them"
            message = f"{world_size}-process run of {fn.__qualname__} {what}; exit codes {codes}{logs}"
            raise SpawnError(message, codes, logs)
        return [torch.load(Path(out, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _read(path: Path) -> str:
    return path.read_text(errors="replace")[-20000:] if path.exists() else "(no output)"
