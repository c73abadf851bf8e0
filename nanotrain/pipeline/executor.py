"""The one executor: runs this rank's planned steps for one batch of micro-batches.

Forward keeps, per in-flight micro-batch, only what backward needs: the stage input (whose
gradient goes upstream) and the autograd edge of the stage output. The output tensor itself is
dropped once sent, Megatron's ``deallocate_output_tensor`` without touching ``.data``: backward
starts from the edge (``torch.autograd.backward`` accepts a ``GradientEdge``), so the output's
memory is freed unless its own grad_fn saved it. Parameter gradients accumulate in ``.grad``.

``on_stage_done(stage)`` is called right after the last backward action (B, I or W) of the step
of each of this rank's stages: from then on no gradient of that stage's leaves changes in this
step. It is the seam for work applied from outside, such as starting the data-parallel reduction
of those gradients while the other stages are still in their cool-down; the pipeline does not
know what it is used for.
"""
from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import Callable, ContextManager, Sequence

import torch
from torch.autograd.graph import get_gradient_edge

from nanotrain.core.linear import Pending, apply_weight_grads, deferring_weight_grads
from nanotrain.core.models.documents import Documents
from nanotrain.pipeline.build import Pipeline
from nanotrain.pipeline.comm_plan import Op
from nanotrain.pipeline.memory import ActivationMeter
from nanotrain.pipeline.p2p import Batch
from nanotrain.pipeline.schedule import Action, Message, consumes, produces

KIND_NAMES = {"F": "forward", "B": "backward", "I": "input-gradient backward", "W": "weight-gradient backward"}
Timer = Callable[[Action], ContextManager]
StageDone = Callable[[int], None]


def last_backwards(actions: tuple[Action, ...]) -> dict[Action, int]:
    """The last backward action (B, I or W) of each stage in ``actions``, mapped to its stage."""
    return {a: s for s, a in {a.stage: a for a in actions if a.kind in "BIW"}.items()}


class _Executor:
    def __init__(self, pipe: Pipeline, inputs: torch.Tensor, targets: torch.Tensor,
                 meter: ActivationMeter | None, timer: Timer | None, denom: float | None, loss_scale: float | None,
                 on_stage_done: StageDone | None = None, seeds: Sequence[int | None] | None = None,
                 positions: torch.Tensor | None = None):
        self.pipe, self.inputs, self.targets, self.meter, self.timer = pipe, inputs, targets, meter, timer
        self.seeds = seeds or [None] * pipe.schedule.n_microbatches
        self.positions = positions
        self.loss_scale, self.on_stage_done = loss_scale, on_stage_done
        self.done_after = last_backwards(pipe.schedule.ranks[pipe.rank])
        self.device = pipe.ctx.device
        self.denom = pipe.model.denominator(targets) if denom is None else denom
        self.split = pipe.schedule.split_backwards()
        self.received: dict[Message, torch.Tensor] = {}  # posted or local, not yet consumed
        self.arriving: dict[Message, Batch] = {}  # remote receives whose batch may not be done
        self.outbox: dict[Message, torch.Tensor] = {}  # produced, waiting for their planned batch
        self.posted: list[Batch] = []
        self.stage_inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], object] = {}  # GradientEdge, or the loss on the last stage
        self.deferred: dict[tuple[int, int], Pending] = {}
        self.loss = torch.zeros((), device=self.device)

    def run(self) -> torch.Tensor:
        for step in self.pipe.steps:
            self.post(step.ops)
            if step.action is not None:
                a = step.action
                self.pipe.ctx.where = f"stage {a.stage}, {KIND_NAMES[a.kind]} of micro-batch {a.mb}"
                need = consumes(a, self.pipe.schedule.n_stages)
                received = None if need is None else self.take(need)  # outside the timer: waiting is not work
                with self.timer(a) if self.timer else nullcontext():
                    {"F": self.forward, "B": self.backward, "I": self.backward, "W": self.weights}[a.kind](a, received)
                if self.on_stage_done is not None and a in self.done_after:
                    self.on_stage_done(self.done_after[a])
            self.measure()
        self.pipe.ctx.where = "the last sends of the step"
        for batch in self.posted:
            batch.wait()
        self.posted.clear()
        leftovers = [name for name, d in (("inputs", self.stage_inputs), ("outputs", self.outputs),
                                          ("W passes", self.deferred), ("messages", self.received)) if d]
        if leftovers:
            raise RuntimeError(f"schedule {self.pipe.schedule.name!r} left {', '.join(leftovers)} unused on rank "
                               f"{self.pipe.rank}; validate() should have caught this, please report it")
        return self.loss

    def post(self, ops: tuple[Op, ...]) -> None:
        if not ops:
            return
        pairs = []
        for op in ops:
            if op.send:
                pairs.append((op, self.outbox.pop(op.msg)))
            else:
                shape, dtype = self.pipe.message_shape(op.msg)
                pairs.append((op, torch.empty(shape, dtype=dtype, device=self.device)))
        batch = Batch(pairs, self.pipe.global_rank, self.pipe.rank_name)
        for op, t in pairs:
            if not op.send:
                self.received[op.msg], self.arriving[op.msg] = t, batch
        # Sends that are done no longer need their tensors: drop them so memory stays bounded.
        self.posted = [b for b in self.posted if not b.done()] + [batch]

    def take(self, msg: Message) -> torch.Tensor:
        if msg in self.arriving:
            self.arriving.pop(msg).wait()
        return self.received.pop(msg)

    def emit(self, msg: Message, t: torch.Tensor) -> None:
        t = t.detach().contiguous()
        if self.pipe.schedule.rank_of(msg.stage) == self.pipe.rank:
            self.received[msg] = t  # the next stage is on this rank (one rank, several stages)
        else:
            self.outbox[msg] = t

    def forward(self, a: Action, received: torch.Tensor | None) -> None:
        spec, key = self.pipe.stages[a.stage], (a.stage, a.mb)
        if spec.is_first:
            # A copy: a view would keep (and the meter would count) the whole batch's storage.
            x = self.inputs[a.mb].to(self.device, non_blocking=True, copy=True)
        else:
            x = received.requires_grad_()
            self.stage_inputs[key] = x
        targets = self.targets[a.mb].to(self.device, non_blocking=True, copy=True) if spec.is_last else None
        with ExitStack() as stack:
            if self.meter is not None:
                stack.enter_context(self.meter.saving())
            if key in self.split:
                self.deferred[key] = []
                stack.enter_context(deferring_weight_grads(self.deferred[key]))
            y = spec.forward(self.pipe.params, x, targets, self.denom, self.seeds[a.mb], self.documents(a.mb))
        if spec.is_last:
            self.outputs[key] = y
            self.loss += y.detach()
        else:
            self.emit(produces(a, self.pipe.schedule.n_stages), y)
            self.outputs[key] = get_gradient_edge(y)

    def documents(self, mb: int) -> Documents | None:
        """Micro-batch ``mb``'s packed rows, their mask built where a stage runs it (every stage attends by it)."""
        if self.positions is None:
            return None
        return Documents.of(self.positions[mb].to(self.device, non_blocking=True, copy=True))

    def backward(self, a: Action, received: torch.Tensor | None) -> None:
        spec, key = self.pipe.stages[a.stage], (a.stage, a.mb)
        out = self.outputs.pop(key)
        if spec.is_last:
            torch.autograd.backward([out if self.loss_scale is None else out * self.loss_scale])
        else:
            torch.autograd.backward([out], [received])
        if not spec.is_first:
            self.emit(produces(a, self.pipe.schedule.n_stages), self.stage_inputs.pop(key).grad)

    def weights(self, a: Action, received: None) -> None:
        apply_weight_grads(self.deferred.pop((a.stage, a.mb)))

    def held(self) -> list[torch.Tensor]:
        w_inputs = [t for pending in self.deferred.values() for _, x, g in pending for t in (x, g)]
        sending = [t for b in self.posted for op, t in b.ops if op.send]
        return [*self.stage_inputs.values(), *self.received.values(), *self.outbox.values(), *sending, *w_inputs]

    def measure(self) -> None:
        if self.meter is not None:
            self.meter.sample(self.held())


def run_step(pipe: Pipeline, inputs: torch.Tensor, targets: torch.Tensor, meter: ActivationMeter | None = None,
             timer: Timer | None = None, denom: float | None = None, loss_scale: float | None = None,
             on_stage_done: StageDone | None = None, seeds: Sequence[int | None] | None = None,
             positions: torch.Tensor | None = None) -> torch.Tensor:
    """Forward and backward of one batch; gradients accumulate into this rank's parameters.

    ``inputs`` and ``targets`` are ``[n_microbatches, micro_batch, ...]``; only the first and
    last stage read them. Returns this rank's summed loss (the batch loss on the last stage's
    rank, zero elsewhere). Tied copies are not yet reduced: see ``train.finish_grads``. ``denom``
    replaces the model's loss denominator of ``targets`` when they are a slice of a larger batch
    (data parallelism: the whole batch's count of valid targets). ``loss_scale``: backward starts from
    the loss times it (fp16's dynamic loss scaling, ``train.scaler``); the loss returned is unscaled.
    ``on_stage_done``: see the module docstring. ``seeds``: each micro-batch's dropout seed (default none).
    ``positions``: packed rows' (``core.models.documents``), shaped as ``inputs``; every stage reads them.
    """
    m = pipe.schedule.n_microbatches
    if inputs.shape[0] != m or targets.shape[0] != m:
        raise ValueError(f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} must have the schedule's "
                         f"{m} micro-batches as their first dimension; reshape to [{m}, micro_batch, ...]")
    if pipe.ctx.device.type == "cuda":
        # Pinned, each micro-batch's copy to the device is queued without waiting on the host.
        inputs, targets = (t.pin_memory() if t.device.type == "cpu" else t for t in (inputs, targets))
    return _Executor(pipe, inputs, targets, meter, timer, denom, loss_scale, on_stage_done, seeds, positions).run()
