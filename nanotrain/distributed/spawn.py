"""Run a function on N local processes that form a process group, as torchrun would.

The one spawner of nanotrain, used by the tests and by the tasks run without torchrun. Each process
gets torchrun's variables, runs ``fn(*args)`` (which joins the group with ``init_distributed``, as
it would under torchrun) and hands back its return value; if any process fails or the time runs
out, every process is stopped and the error shows each rank's output.
"""
from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


class SpawnError(RuntimeError):
    def __init__(self, message: str, exit_codes: list, logs: str):
        super().__init__(message)
        self.exit_codes, self.logs = exit_codes, logs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, out: str, capture: bool, threads: int, fn: Callable, args: tuple) -> None:
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
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1) from None
    torch.save(result, f"{out}/rank{rank}.pt")


def spawn(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 300.0, capture: bool = True,
          start_method: str = "spawn", threads: int | None = None, grace_s: float = 10.0) -> list[Any]:
    """``[fn(*args) on rank r for r in range(world_size)]``; ``fn`` must be importable (module level).

    With ``capture`` each rank's stdout and stderr go to a file that is shown only on failure.
    ``start_method="fork"`` skips importing torch again in every process (seconds each on a small
    CPU machine: the tests use it); keep "spawn" once CUDA has been touched. ``threads``: torch
    threads per process (default: the cores shared out). ``grace_s``: how long the other processes
    get to stop by themselves (their failure watch) once one has failed, before they are killed.
    """
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context(start_method)
    with tempfile.TemporaryDirectory(prefix="nanotrain-spawn-") as out:
        port = free_port()
        procs = [ctx.Process(target=_child, args=(r, world_size, port, out, capture, threads, fn, args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline, failed = time.monotonic() + timeout_s, False
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
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
        if timed_out or any(codes):
            logs = "".join(f"\n--- rank {r} (exit code {codes[r]}) ---\n{_read(Path(out, f'rank{r}.log'))}"
                           for r in range(world_size)) if capture else ""
            what = f"timed out after {timeout_s:.0f} s" if timed_out else "failed"
            message = f"{world_size}-process run of {fn.__qualname__} {what}; exit codes {codes}{logs}"
            raise SpawnError(message, codes, logs)
        return [torch.load(Path(out, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _read(path: Path) -> str:
    return path.read_text(errors="replace")[-20000:] if path.exists() else "(no output)"

