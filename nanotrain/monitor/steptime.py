"""Where a step's time goes: forward, backward, optimizer and waits for copies, per step.

A trainer marks the moment each phase starts (``mark``); the time from one mark to the next counts
for the phase named by the first. On the CPU a mark is ``time.perf_counter()``. On a GPU it is a
CUDA event recorded on the current (compute) stream: recording does not wait, and the events are
read only in ``take``, after the step's own host sync (the loss's ``.item()``), when all of them
have been reached; so the split adds no sync to the step, and what it measures is the compute
stream's timeline, the GPU-side gaps left by a host that blocked (on an optimizer worker, say)
included. A copy wait is its own phase: ``wait`` marks ``copy_wait`` around the stream's wait for
an event and then returns to the phase it interrupted.

The one wait it does add: ``take`` waits for the step's last mark, so GPU work that a trainer queues
after its own last sync (the adapters' ``optimizer.step()``, the streamed trainer's last update)
finishes inside the step instead of under the start of the next one; the resident trainer queues
none. A mark costs one event (a few microseconds of host time); a streamed step makes about two
per block and micro-batch where it already timed its copy waits, and a few more per block.
"""
from __future__ import annotations

import time

import torch

PHASES = ("forward", "backward", "optimizer", "copy_wait")
Stamp = torch.cuda.Event | float


def stamp(device: torch.device) -> Stamp:
    """Now on ``device``'s current stream: a CUDA event recorded there (no wait), or ``perf_counter`` on the CPU."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def seconds_between(a: Stamp, b: Stamp) -> float:
    """Seconds from stamp ``a`` to ``b`` (CUDA events: both reached, their stream's time)."""
    return a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a


class StepClock:
    def __init__(self, device: torch.device):
        self.device = device
        self._cuda = device.type == "cuda"
        self._marks: list[tuple[str, Stamp]] = []
        self.phase = "forward"

    def start(self) -> None:
        """A step begins, in ``forward``: marks left from outside a step (an evaluation's copy waits) go."""
        self._marks = []
        self.mark("forward")

    def mark(self, phase: str) -> None:
        """From now on the step's time counts for ``phase`` (one of ``PHASES``, or ``end``)."""
        self._marks.append((phase, stamp(self.device)))
        self.phase = phase

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Make the compute stream wait for ``event`` (a copy's end), timed as ``copy_wait``."""
        if event is None or not self._cuda:
            return
        resume = self.phase
        self.mark("copy_wait")
        torch.cuda.current_stream(self.device).wait_event(event)
        self.mark(resume)

    def take(self) -> dict[str, float]:
        """Seconds per phase (``forward_s``, ... as ``StepResult`` names them) between the first and the last
        mark since the last call; starts afresh. On a GPU call it after the step's last host sync (it
        waits for the last mark, long reached by then)."""
        marks, self._marks = self._marks, []
        out = dict.fromkeys(PHASES, 0.0)
        if self._cuda and marks:
            marks[-1][1].synchronize()
        for (phase, a), (_, b) in zip(marks, marks[1:]):
            if phase in out:
                out[phase] += seconds_between(a, b)
        return {f"{phase}_s": seconds for phase, seconds in out.items()}
