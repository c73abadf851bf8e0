"""The ``Trainer`` protocol for a 3D-parallel run, so the one loop (``train.loop``) trains it."""
from __future__ import annotations

import math

import torch

from nanotrain.parallel3d.optimizer import Adam3D
from nanotrain.parallel3d.step import Parallel3D, train_step_3d
from nanotrain.train.adapters import AutogradTrainer
from nanotrain.train.step import StepResult


class Parallel3DTrainer(AutogradTrainer):
    """This rank's share of a step; every rank is handed the same global batch ``[B, seq]``.

    ``optimizer`` is a torch optimizer over ``p3d.parameters()`` or nanotrain's ``Adam3D`` (8-bit
    moments, fp32 masters, ZeRO-1). ``state_dict`` holds this rank's shard only (its stages'
    leaves, TP-sliced) and their optimizer state: saved and resumed per rank, at the same layout.
    """

    def __init__(self, p3d: Parallel3D, optimizer: torch.optim.Optimizer | Adam3D):
        super().__init__(p3d.pipe.params, lambda x, y: torch.zeros(()), optimizer, p3d.plan.cfg)
        self.p3d = p3d

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> StepResult:
        loss = train_step_3d(self.p3d, self.opt, tokens, targets)
        self.step_count += 1
        value = float(loss)
        return StepResult(value, not math.isfinite(value), targets.numel())

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return self.p3d.named_parameters()

    def set_lr(self, lr: float) -> None:
        if isinstance(self.opt, Adam3D):
            self.opt.set_lr(lr)
        else:
            super().set_lr(lr)

    def state_dict(self) -> dict[str, torch.Tensor]:
        if not isinstance(self.opt, Adam3D):
            return super().state_dict()
        return {**{f"param.{n}": p.detach() for n, p in self.named_parameters()}, **self.opt.state_dict()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if not isinstance(self.opt, Adam3D):
            super().load_state_dict(state)
            return
        self.opt.load_state_dict({k: v for k, v in state.items() if not k.startswith("param.")})

    def close(self) -> None:
        if isinstance(self.opt, Adam3D):
            self.opt.close()
