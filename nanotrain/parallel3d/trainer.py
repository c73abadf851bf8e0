"""The ``Trainer`` protocol for a 3D-parallel run, so the one loop (``train.loop``) trains it."""
from __future__ import annotations

import math

import torch

from nanotrain.parallel3d.step import Parallel3D, train_step_3d
from nanotrain.train.adapters import AutogradTrainer
from nanotrain.train.step import StepResult


class Parallel3DTrainer(AutogradTrainer):
    """This rank's share of a step; every rank is handed the same global batch ``[B, seq]``.

    ``state_dict`` holds this rank's shard only (its stages' leaves, TP-sliced) and their AdamW
    moments: saved and resumed per rank, at the same layout.
    """

    def __init__(self, p3d: Parallel3D, optimizer: torch.optim.Optimizer):
        super().__init__(p3d.pipe.params, lambda x, y: torch.zeros(()), optimizer, p3d.plan.cfg)
        self.p3d = p3d

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> StepResult:
        loss = train_step_3d(self.p3d, self.opt, tokens, targets)
        self.step_count += 1
        value = float(loss)
        return StepResult(value, not math.isfinite(value), targets.numel())

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return self.p3d.named_parameters()
