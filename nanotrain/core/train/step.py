"""What every trainer shares: the ``Trainer`` protocol, its step result, and the step's pieces.

A trainer owns a model's weights and optimizer state and turns one batch into one optimizer
step. The resident trainer (``train.resident``), the streamed one (``stream.trainer``) and the
adapters of the parallel engines implement this protocol; ``train.loop`` runs any of them. The
resident trainer takes its units' weights from a ``Weights`` (resident, or ZeRO-3's gathered ones).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch

from nanotrain.core.loss import target_count, validate_targets
from nanotrain.core.models import model_spec, run
from nanotrain.core.models.documents import check_positions
from nanotrain.core.models.run import BlockFn
from nanotrain.core.models.spec import ModelSpec, Unit
from nanotrain.monitor.steptime import StepClock
from nanotrain.core.optim.carrier import Carrier
from nanotrain.core.train.scaler import LossScaler, split_state
from nanotrain.core.tree import Tree
# ``model`` below: a config of any family, or its ``ModelSpec``.


def dropout_seed(model: Any, base: int, step: int, micro: int) -> int | None:
    """The dropout seed of micro-batch ``micro`` of step ``step`` (None without dropout); the
    embedding uses it, block ``i`` uses it + 1 + i (``run.block_seed``): every mask distinct and replayable."""
    spec = model_spec(model)
    if not spec.dropout.any:
        return None
    return ((base * 1_000_003 + step) * 10_007 + micro) * (spec.n_layer + 1)


def batch_denominator(tokens: torch.Tensor, targets: torch.Tensor, batch: int, model: Any,
                      positions: torch.Tensor | None = None) -> int:
    """Check a step's ``[batch, seq]`` tokens and targets (and packed rows' positions); the count of targets that
    enter the loss."""
    if tokens.shape[0] != batch or targets.shape != tokens.shape:
        raise ValueError(f"expected tokens and targets of shape [{batch}, seq], got "
                         f"{tuple(tokens.shape)} and {tuple(targets.shape)}")
    spec = model_spec(model)
    run.validate_tokens(spec, tokens)
    validate_targets(targets, spec.vocab_size)
    if positions is not None:
        check_positions(positions, tokens)
    return target_count(targets)


def micro_batches(size: int, device: torch.device, *rows: torch.Tensor | None) -> Iterator[list]:
    """Each micro-batch of ``size`` rows of ``rows`` (tokens, targets, packed rows' positions or None) on ``device``
    (through pinned memory to a GPU, without waiting)."""
    pin = device.type == "cuda"
    parts = [t.split(size) if t is not None else None for t in rows]
    for m in range(len(parts[0])):
        yield [None if p is None else (p[m].pin_memory() if pin else p[m]).to(device, non_blocking=True)
               for p in parts]


def masters_tree(model: Any, state: dict[str, torch.Tensor]) -> Tree:
    """The fp32 masters of an optimizer's ``state_dict`` as a parameter tree (the same tensors)."""
    masters = ((key.removeprefix("master."), t) for key, t in state.items() if key.startswith("master."))
    return run.tree_from(model_spec(model), masters)


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


class HoldsOptimizer:
    """A trainer whose optimizer owns the fp32 masters and moments hands these over to it."""

    spec: ModelSpec
    opt: Carrier
    scaler: LossScaler | None = None  # fp16: its state is saved beside the optimizer's

    def master_params(self) -> Tree:
        """The fp32 master weights as a parameter tree (the optimizer's own buffers, not copies)."""
        return masters_tree(self.spec, self.opt.state_dict())

    def set_lr(self, lr: float) -> None:
        self.opt.set_lr(lr)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.opt.state_dict() | (self.scaler.state_dict() if self.scaler else {})

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        opt_state, scaler_state = split_state(state)
        self.opt.load_state_dict(opt_state)
        if self.scaler:
            self.scaler.load_state_dict(scaler_state)

    def close(self) -> None:
        self.opt.close()


@dataclass
class Pass:
    """Where a step stands, shared by a resident trainer and its weights: the micro-batch running, the step's
    last one, fp16's 1/scale (None without fp16) and the step's clock."""
    clock: StepClock
    micro: int = 0
    last: int = 0
    unscale: torch.Tensor | None = None

    def accumulate(self, acc: torch.Tensor, grad: torch.Tensor) -> bool:
        """Add this micro-batch's ``grad`` into its fp32 sum ``acc`` (the first one copied); on the last, unscale the
        sum in fp32 (before clipping and the optimizer see it). Whether ``acc`` is now final."""
        accumulate_fp32([acc], [grad], first=self.micro == 0)
        if self.micro == self.last and self.unscale is not None:
            acc.mul_(self.unscale)
        return self.micro == self.last


class Weights(Protocol):
    """Where a resident trainer's units take their weights, where their gradients go, and the optimizer behind
    both, chosen once: ``train.resident.ResidentWeights``, or ZeRO-3's ``GatheredWeights`` (``data_parallel.zero3``),
    which gathers each unit's shards just before use."""

    opt: Carrier
    block_fn: BlockFn | None  # how ``run_units`` runs a block (a recompute policy); None: plainly

    def begin(self) -> None: ...  # micro-batch ``Pass.micro`` is about to run its forward

    def run(self, unit: Unit, fn: Callable, x: torch.Tensor | None) -> torch.Tensor: ...  # ``run_units``' hook

    def end(self) -> None: ...  # its backward is done

    def finish(self) -> torch.Tensor | None: ...  # every unit handed over; the step's gradient norm, where clipped

    # ``run_units``' hook for evaluation, under no_grad: ``unit`` on the weights the next step will use
    def evaluate(self, unit: Unit, fn: Callable, x: torch.Tensor | None) -> torch.Tensor: ...


def unit_reads(spec: ModelSpec) -> dict[str, list[str]]:
    """The units each unit reads, in forward order: its own, and for the head also the unit that holds the head's
    output matrix when it is not the head's own (a tied embedding)."""
    out = {unit.name: [unit.name] for unit in spec.units}
    holder = spec.unit_of()[spec.head_weight]
    if holder != spec.head_unit.name:
        out[spec.head_unit.name].append(holder)
    return out


class Trainer(Protocol):
    """One optimizer step per batch, and the state that resumes it."""

    cfg: Any                # the model's config (None for a model of no family: ``tasks.tensor_parallel``'s CIFAR net)
    spec: ModelSpec | None  # ``model_spec(cfg)``: what the engines read
    step_count: int

    # ``positions``: packed rows' (``core.models.documents``), None for one document per row
    def step(self, tokens: torch.Tensor, targets: torch.Tensor,
             positions: torch.Tensor | None = None) -> StepResult: ...

    def set_lr(self, lr: float) -> None: ...  # the learning rate of the steps from now on

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor,
                  positions: torch.Tensor | None = None) -> float: ...  # no grad, no dropout

    def master_params(self) -> Tree: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def close(self) -> None: ...


def accumulate_fp32(sums: list[torch.Tensor], grads: list[torch.Tensor], first: bool) -> None:
    """``sums += grads`` (``sums = grads`` when ``first``): fp32 sums of low-precision gradients.

    The streamed trainer compiles it with its blocks: eager's add (and copy) of a bf16 tensor into an
    fp32 one runs an unvectorised mixed-dtype kernel, 28 ms of a 0.86 s gpt2-large step with an
    8-block tail; the compiled loop is one vectorised kernel per tensor.
    """
    for acc, g in zip(sums, grads):
        acc.copy_(g) if first else acc.add_(g)
