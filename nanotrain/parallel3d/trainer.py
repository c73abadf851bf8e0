"""The ``Trainer`` protocol for a 3D-parallel run, so the one loop (``train.loop``) trains it."""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

from nanotrain.parallel3d.optimizer import Adam3D
from nanotrain.parallel3d.step import Parallel3D, grads_3d, update_3d
from nanotrain.pipeline.schedule import Action
from nanotrain.train.adapters import AutogradTrainer
from nanotrain.train.step import StepResult


class Parallel3DTrainer(AutogradTrainer):
    """This rank's share of a step; every rank is handed the same global batch ``[B, seq]``.

    ``optimizer`` is a torch optimizer over ``p3d.parameters()`` or nanotrain's ``Adam3D`` (8-bit
    moments, fp32 masters, ZeRO-1). ``state_dict`` holds this rank's shard only (its stages'
    leaves, TP-sliced) and their optimizer state (under ZeRO-1 its shard of that state): saved and
    resumed per rank, at the same layout (``parallel3d.checkpoint``).

    The step-time split (``monitor.steptime``, as the other trainers report it) is this rank's, and
    in a pipeline forward and backward interleave, so it splits the rank's timeline, not the model:
    ``forward_s`` is the time inside the schedule's F actions (this rank's stages' forward compute,
    their TP collectives included); ``backward_s`` inside its B, I and W actions (the recomputed
    forward too); ``copy_wait_s`` everything else before the update: waiting for the neighbouring
    stages' activations and gradients (the pipeline's bubble), posting sends, the TP sums of
    sequence-parallel partial gradients and starting the DP sums as each stage finishes, waiting
    for the DP sums and the tied-embedding all-reduce, the loss broadcast; ``optimizer_s`` the
    update (with ZeRO-1's all-gather of the new weights). On a GPU each is the compute stream's time
    between the marks, so a collective queued on it counts where it runs.
    """

    copy_waits = True  # the pipeline's waits for its neighbours and the reductions

    def __init__(self, p3d: Parallel3D, optimizer: torch.optim.Optimizer | Adam3D):
        super().__init__(p3d.pipe.params, lambda x, y: torch.zeros(()), optimizer, p3d.plan.spec)
        self.p3d = p3d

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> StepResult:
        self.clock.start()
        self.clock.mark("copy_wait")
        loss = grads_3d(self.p3d, tokens, targets, timer=self._timed)
        self.clock.mark("optimizer")
        update_3d(self.p3d, self.opt)
        self.clock.mark("end")
        self.step_count += 1
        value = float(loss)
        return StepResult(value, not math.isfinite(value), targets.numel(), **self.clock.take())

    @contextlib.contextmanager
    def _timed(self, action: Action) -> Iterator[None]:
        self.clock.mark("forward" if action.kind == "F" else "backward")
        yield
        self.clock.mark("copy_wait")

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
