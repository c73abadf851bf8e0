"""Measured pipeline timelines: when each compute action of a step ran on this rank.

``ActionClock`` is the executor's ``timer``: CUDA events on the compute stream around every
action (device time, so waiting for a message is idle, not work), or the wall clock on CPU. It
keeps every step's spans, in ms from that step's start, for the bubble, the per-kind mean
durations (the measured costs to replay the schedule with) and the timeline plot.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from nanotrain.monitor.steptime import Stamp, seconds_between, stamp
from nanotrain.pipeline.schedule import Action

Span = tuple[Action, float, float]  # action, start ms, end ms from the step's start


class ActionClock:
    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self._steps: list[tuple[Stamp, list[tuple[Action, Stamp, Stamp]]]] = []

    def start_step(self) -> None:
        """Call before each step; nothing synchronises until the spans are read."""
        self._steps.append((stamp(self.device), []))

    @contextmanager
    def __call__(self, action: Action) -> Iterator[None]:
        if not self._steps:
            raise RuntimeError("ActionClock: call start_step() before the step's actions")
        start = stamp(self.device)
        yield
        self._steps[-1][1].append((action, start, stamp(self.device)))

    def _ms(self, a: Stamp, b: Stamp) -> float:
        return 1e3 * seconds_between(a, b)

    def spans(self, step: int = -1) -> list[Span]:
        """One step's actions (default: the last), in ms from its start."""
        if self.cuda:
            torch.cuda.synchronize()
        origin, marks = self._steps[step]
        return [(a, self._ms(origin, s), self._ms(origin, e)) for a, s, e in marks]

    def busy_per_step_s(self) -> float:
        """Mean seconds of compute per step over every step timed."""
        total = sum(end - start for i in range(len(self._steps)) for _, start, end in self.spans(i))
        return total / 1e3 / max(len(self._steps), 1)


def mean_ms_by_kind(spans: list[Span]) -> dict[tuple[int, str], float]:
    """Mean duration of each (stage, kind) among ``spans``."""
    sums: dict[tuple[int, str], list[float]] = {}
    for a, start, end in spans:
        sums.setdefault((a.stage, a.kind), []).append(end - start)
    return {k: sum(v) / len(v) for k, v in sums.items()}
