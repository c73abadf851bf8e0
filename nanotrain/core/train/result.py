"""What one optimizer step reports: the ``StepResult`` every trainer returns and the loop reads.

Its own module because both the step's pieces (``train.step``) and the loss scaler (``train.scaler``, which
records the scale into it) take it, and the step's pieces hold a scaler.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepResult:
    loss: float
    skipped: bool   # the loss (or the clipped gradient norm) was not finite: the weights stay as they were
    tokens: int     # tokens that counted in the loss
    copy_wait_s: float | None = None  # time the compute stream waited for host copies (streaming)
    # Where the step's time went (monitor.steptime): with copy_wait_s they sum to about the step's time.
    forward_s: float | None = None
    backward_s: float | None = None
    optimizer_s: float | None = None  # the update, or the step's waits for it where it overlaps the backward
    grad_norm: float | None = None    # the global gradient norm before clipping, where the trainer clips
    clipped: bool | None = None       # whether clipping scaled this step's gradients
    loss_scale: float | None = None   # fp16: the loss scale this step's backward ran at (train.scaler)
    overflow: bool = False            # skipped by the loss scaler finding its scale (backed off): not a failure
