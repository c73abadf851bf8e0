"""Is a run still training? Consecutive skipped steps stop it; a loss far above its best is warned about.

A trainer skips a step whose loss is not finite and leaves the weights as they were: right for a
rare overflow, useless when every step skips (NaN weights, a learning rate that sent them to
1e30). ``Health`` counts those steps and stops the run, before it saves, once there are too many
in a row; and it says when the loss stays far above the lowest it has reached (divergence that
has not produced a NaN yet). The loop feeds it every step, so every trainer gets both checks.
"""
from __future__ import annotations

import math


class TrainingStopped(RuntimeError):
    """The run cannot make progress; the message says why and what to change."""


BLOWUP_FACTOR = 10.0  # a loss above this many times the lowest so far ...
BLOWUP_STEPS = 3      # ... for this many steps in a row is warned about


class Health:
    def __init__(self, max_skipped_steps: int = 10):
        self.max_skipped_steps = max_skipped_steps  # consecutive non-finite steps that stop the run (0: never)
        self.skipped_run = 0       # consecutive skipped steps
        self.first_skipped = 0
        self.lowest = math.inf
        self.high_run = 0          # consecutive steps above BLOWUP_FACTOR x lowest
        self.warned = False

    def observe(self, step: int, loss: float, skipped: bool) -> str | None:
        """Take one step's outcome; returns a warning line to print, or raises ``TrainingStopped``."""
        if skipped:
            self.first_skipped = self.first_skipped if self.skipped_run else step
            self.skipped_run += 1
            if self.max_skipped_steps and self.skipped_run >= self.max_skipped_steps:
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
        if loss > BLOWUP_FACTOR * self.lowest:
            self.high_run += 1
        else:
            self.high_run, self.warned = 0, False
        if self.high_run >= BLOWUP_STEPS and not self.warned:
            self.warned = True
            return (f"warning: the loss has been above {BLOWUP_FACTOR:g}x its lowest ({self.lowest:.4g}) for "
                    f"{self.high_run} steps (now {loss:.4g} at step {step}): the run is diverging; lower --lr")
        return None

    def finish(self, steps_run: int) -> None:
        """At the end of a run, before it saves: refuse when most of its steps were skipped in a row at its end
        (a short run that diverged never reaches ``max_skipped_steps``)."""
        if self.skipped_run and 2 * self.skipped_run > steps_run:
            raise TrainingStopped(
                f"the last {self.skipped_run} of this run's {steps_run} steps had a non-finite loss and were skipped: "
                f"the weights hold inf/NaN or diverged (lower --lr, or check the starting checkpoint); not saving")
