"""Is a run still training? Consecutive skipped steps stop it; a loss far above its best is warned about.

A trainer skips a step whose loss is not finite and leaves the weights as they were: right for a
rare overflow, useless when every step skips (NaN weights, a learning rate that sent them to
1e30). ``Health`` counts those steps and stops the run, before it saves, once there are too many
in a row; and it says when the loss stays far above the lowest it has reached (divergence that
has not produced a NaN yet). The loop feeds it every step, so every trainer gets both checks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


class TrainingStopped(RuntimeError):
    """The run cannot make progress; the message says why and what to change."""


@dataclass(frozen=True)
class HealthConfig:
    max_skipped_steps: int = 10   # consecutive non-finite steps that stop the run (0: never)
    blowup_factor: float = 10.0   # a loss above this many times the lowest so far ...
    blowup_steps: int = 3         # ... for this many steps in a row is warned about (0: never)


class Health:
    def __init__(self, hcfg: HealthConfig = HealthConfig()):
        self.hcfg = hcfg
        self.skipped_run = 0       # consecutive skipped steps
        self.first_skipped = 0
        self.lowest = math.inf
        self.high_run = 0          # consecutive steps above blowup_factor x lowest
        self.warned = False

    def observe(self, step: int, loss: float, skipped: bool) -> str | None:
        """Take one step's outcome; returns a warning line to print, or raises ``TrainingStopped``."""
        h = self.hcfg
        if skipped:
            self.first_skipped = self.first_skipped if self.skipped_run else step
            self.skipped_run += 1
            if h.max_skipped_steps and self.skipped_run >= h.max_skipped_steps:
                raise TrainingStopped(
                    f"{self.skipped_run} steps in a row ({self.first_skipped}..{step}) had a non-finite loss and were "
                    f"skipped, so the weights no longer change: they hold inf/NaN (check the starting checkpoint) or "
                    f"the learning rate made them diverge (lower --lr). Nothing was saved from this run's last "
                    f"steps (--max-skipped-steps sets the limit)")
            return None
        self.skipped_run = 0
        if not math.isfinite(loss):
            return None
        self.lowest = min(self.lowest, loss)
        if loss > h.blowup_factor * self.lowest:
            self.high_run += 1
        else:
            self.high_run, self.warned = 0, False
        if h.blowup_steps and self.high_run >= h.blowup_steps and not self.warned:
            self.warned = True
            return (f"warning: the loss has been above {h.blowup_factor:g}x its lowest ({self.lowest:.4g}) for "
                    f"{self.high_run} steps (now {loss:.4g} at step {step}): the run is diverging; lower --lr")
        return None

    def finish(self, steps_run: int) -> None:
        """At the end of a run, before it saves: refuse when most of its steps were skipped in a row at its end
        (a short run that diverged never reaches ``max_skipped_steps``)."""
        if self.skipped_run and 2 * self.skipped_run > steps_run:
            raise TrainingStopped(
                f"the last {self.skipped_run} of this run's {steps_run} steps had a non-finite loss and were skipped: "
                f"the weights hold inf/NaN or diverged (lower --lr, or check the starting checkpoint); not saving")
