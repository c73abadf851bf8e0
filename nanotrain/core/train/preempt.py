"""Clean pre-emption: SIGTERM or Ctrl-C stops a run at the next step boundary, saved.

Schedulers (Slurm, Kubernetes, spot instances) send SIGTERM and then, after a grace period,
SIGKILL. The first SIGTERM or Ctrl-C only raises a flag: the step under way finishes (its
updates are in flight on other threads and streams, and a step cut in half is worth nothing),
the loop sees the flag at the step boundary, saves and returns, and the task says how to resume.
A signal that arrives before the first step (while the run loads) stops it before that step,
with nothing to save. A second signal exits at once: saves write a temporary folder and rename
it into place, so whatever the moment, the last complete checkpoint stays whole.

A run stopped early ends as the signal would have ended it (``exit_by``: the signal's default
action, so a shell reads 143 for SIGTERM and 130 for Ctrl-C, and torchrun, Slurm and systemd read
"terminated by SIGTERM"): never 0, which says the run is done, so ``&&`` chains and ``afterok``
job dependencies do not go on as if it had finished. A run that finished its steps exits 0 even
if a signal came during its last save.

In a distributed run each rank's flag is all-reduced at every step boundary, so every rank stops
after the same step even when the signal reached them at different moments.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_by(signum: int) -> NoReturn:
    """End this process by ``signum``'s default action, as if it had not been caught (output flushed first)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)
    os._exit(128 + signum)  # not reached: the default action of SIGINT and SIGTERM is to terminate


class StopRequest:
    """A context manager that turns SIGINT and SIGTERM into a stop at the next step boundary (in a distributed
    run every rank holds one; ranks after the first print nothing: ``data_parallel.launch.mute_other_ranks``)."""

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopRequest:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is None:
            self.signal = signum
            print(f"\n{name}: stopping after this step and saving (press Ctrl-C again to exit at once)", flush=True)
            return
        print(f"\n{name} again: exiting now; the last complete checkpoint is intact", flush=True)
        exit_by(signum)

    @property
    def name(self) -> str | None:
        return None if self.signal is None else signal.Signals(self.signal).name

    def requested(self, device: torch.device) -> bool:
        """Whether to stop now; in a distributed run, whether any rank was signalled (``device``: where
        the backend reduces)."""
        if not dist.is_initialized():
            return self.signal is not None
        flag = torch.tensor([self.signal or 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signal is None:
            self.signal = int(flag.item())  # another rank was told
        return bool(flag.item())

    def exit_if_stopped(self) -> None:
        """End the process by the signal that stopped the run early (``exit_by``); return if none did."""
        if self.signal is not None:
            exit_by(self.signal)
