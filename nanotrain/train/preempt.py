"""Clean pre-emption: SIGTERM or Ctrl-C stops a run at the next step boundary, saved.

Schedulers (Slurm, Kubernetes, spot instances) send SIGTERM and then, after a grace period,
SIGKILL. The first SIGTERM or Ctrl-C only raises a flag: the step under way finishes (its
updates are in flight on other threads and streams, and a step cut in half is worth nothing),
the loop sees the flag at the step boundary, saves and returns, and the task exits 0 saying how to
resume. A second signal exits at once: saves write a temporary folder and rename it into place,
so whatever the moment, the last complete checkpoint stays whole.

In a distributed run each rank's flag is all-reduced at every step boundary, so every rank stops
after the same step even when the signal reached them at different moments.
"""
from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """A context manager that turns SIGINT and SIGTERM into a stop at the next step boundary."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | None = None):
        self.group, self.device = group, device or torch.device("cpu")
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
        os._exit(128 + signum)

    @property
    def name(self) -> str | None:
        return None if self.signal is None else signal.Signals(self.signal).name

    def requested(self) -> bool:
        """Whether to stop now; in a distributed run, whether any rank of ``group`` was signalled."""
        if self.group is None and not dist.is_initialized():
            return self.signal is not None
        flag = torch.tensor([self.signal is not None], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() and self.signal is None:
            self.signal = signal.SIGTERM  # another rank was told
        return bool(flag.item())
