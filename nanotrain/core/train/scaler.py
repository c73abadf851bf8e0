"""Dynamic loss scaling for fp16 compute, with ``torch.amp.GradScaler``'s defaults and rules.

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero, above 65504 become inf. The loss is
multiplied by ``scale`` before backward so that small gradients stay representable, and the
gradients are divided by it (in fp32) before clipping and the optimizer. A step whose gradients
overflowed is skipped whole (the optimizer's inf/NaN check) and the scale backed off; after
``growth_interval`` good steps in a row it grows again, so the scale hovers just below overflow.

The state (scale and the run of good steps) goes into the trainer's ``state_dict`` as two scalar
tensors beside the optimizer's, so every checkpoint writer of that trainer keeps it and a resumed
run scales its next step exactly as the uninterrupted one would.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nanotrain.core.train.result import StepResult

KEYS = ("loss_scale.scale", "loss_scale.good_steps")


@dataclass(frozen=True)
class ScalerConfig:
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not (self.init_scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1
                and self.growth_interval >= 1):
            raise ValueError(f"loss scaler {self}: needs init_scale > 0, growth_factor > 1, "
                             f"0 < backoff_factor < 1 and growth_interval >= 1")


class LossScaler:
    def __init__(self, cfg: ScalerConfig = ScalerConfig()):
        self.cfg = cfg
        self.scale = float(cfg.init_scale)
        self.good_steps = 0  # good steps in a row since the last growth or backoff

    def inv_scale(self) -> torch.Tensor:
        """1 / scale as fp32, computed as GradScaler does (in float64, then rounded)."""
        return torch.tensor(1.0 / self.scale, dtype=torch.float32)

    def update(self, overflowed: bool) -> None:
        """After a step: back off when its gradients overflowed, else count it and grow every ``growth_interval``."""
        if overflowed:
            self.scale *= self.cfg.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.cfg.growth_interval:
            self.scale *= self.cfg.growth_factor
            self.good_steps = 0

    def record(self, result: StepResult) -> StepResult:
        """Move the scale by whether the step was skipped, and say so in ``result``. A skip with a finite loss at
        a scale still >= 1 is the scaler finding its scale (``overflow``: the loop's health guard does not
        count it as a failure)."""
        result.loss_scale = self.scale
        self.update(result.skipped)
        result.overflow = result.skipped and math.isfinite(result.loss) and self.scale >= 1
        return result

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {KEYS[0]: torch.tensor(self.scale, dtype=torch.float64), KEYS[1]: torch.tensor(self.good_steps)}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        missing = [k for k in KEYS if k not in sd]
        if missing:
            raise ValueError(f"the checkpoint has no loss-scaler state ({', '.join(missing)}): it was saved by a "
                             f"run without --dtype fp16; resume it with the dtype it was trained in")
        self.scale, self.good_steps = float(sd[KEYS[0]]), int(sd[KEYS[1]])


def split_state(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A trainer's state dict as (the optimizer's entries, the scaler's)."""
    return {k: v for k, v in sd.items() if k not in KEYS}, {k: v for k, v in sd.items() if k in KEYS}
