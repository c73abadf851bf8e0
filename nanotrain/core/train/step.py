"""What every trainer shares: the ``Trainer`` protocol and the step's pieces (its result: ``train.result``).

A trainer owns a model's weights and optimizer state and turns one batch into one optimizer
step. The resident trainer (``train.resident``), the streamed one (``stream.trainer``) and the
adapters of the parallel engines implement this protocol; ``train.loop`` runs any of them. The
resident trainer takes its units' weights from a ``Weights`` (resident, or ZeRO-3's gathered ones).
"""
from __future__ import annotations

import functools
from dataclasses import KW_ONLY, dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch

from nanotrain.core.loss import target_count, validate_targets
from nanotrain.core.models import model_spec, run
from nanotrain.core.models.documents import check_positions
from nanotrain.core.models.run import BlockFn
from nanotrain.core.models.spec import ModelSpec, Unit
from nanotrain.monitor.steptime import StepClock
from nanotrain.core.optim.carrier import Carrier
from nanotrain.core.train.result import StepResult
from nanotrain.core.train.scaler import LossScaler, split_state
from nanotrain.core.train.shard import ShardState, moment_block, whole_shard
from nanotrain.core.tree import Tree, set_path
# ``model`` below: a config of any family, or its ``ModelSpec``.


@dataclass(frozen=True)
class StepConfig:
    """A step's settings every trainer shares: the batch and its micro-batches, the loss's chunks, dropout's seed,
    compiling the block and the gradient clip. The resident trainer's ``TrainConfig`` and the streamed one's
    ``StreamConfig`` extend it with their own (their fields come after ``micro_batch`` by position; these by name)."""
    batch: int
    micro_batch: int
    _: KW_ONLY
    chunk_tokens: int = 2048       # tokens per chunk of the fused LM-head loss
    dropout_seed: int = 0          # dropout masks are a function of (this, step, micro-batch, block)
    compile: bool = False          # torch.compile the block (each engine says what of it runs compiled)
    clip_norm: float | None = None  # clip gradients to this global norm (exact; each engine says its cost)

    def __post_init__(self) -> None:
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip norm {self.clip_norm} must be > 0")
        if self.batch < 1 or self.micro_batch < 1 or self.batch % self.micro_batch:
            raise ValueError(f"batch {self.batch} is not divisible by micro-batch {self.micro_batch}; "
                             f"pick a micro-batch that divides it (e.g. "
                             f"{', '.join(str(d) for d in range(1, self.batch + 1) if self.batch % d == 0)})")


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

    def scaled_result(self, result: StepResult, skipped_before: int) -> StepResult:
        """fp16: whether the optimizer skipped the step (its ``skipped_steps`` were ``skipped_before`` at its start;
        its updates waited for, as the next forward would) and the scaler's record of it. Without fp16: ``result``."""
        if self.scaler is None:
            return result
        self.opt.synchronize()
        result.skipped = self.opt.skipped_steps > skipped_before
        return self.scaler.record(result)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.opt.state_dict() | (self.scaler.state_dict() if self.scaler else {})

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        opt_state, scaler_state = split_state(state)
        self.opt.load_state_dict(opt_state)
        if self.scaler:
            self.scaler.load_state_dict(scaler_state)

    def shard_state(self) -> ShardState:
        """One process's state as one shard of whole leaves (``train.shard``); the optimizer's own buffers."""
        return whole_shard(self.spec, self.state_dict(), moment_block(self.opt.cfg))  # OffloadAdam, StreamedAdam

    def load_shard_state(self, entries: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(entries)  # whole leaves: a piece's entries are the state's own (its name is its path)

    def close(self) -> None:
        self.opt.close()


@dataclass
class Pass:
    """Where a step stands, shared by a trainer and its weights (``train.handover``): the micro-batch running, the
    step's last one (a pipeline's schedule keeps its own), fp16's 1/scale (None without fp16) and the step's clock."""
    clock: StepClock
    micro: int = 0
    last: int = 0
    unscale: torch.Tensor | None = None

    def accumulate(self, acc: torch.Tensor, grad: torch.Tensor) -> bool:
        """Add this micro-batch's ``grad`` into its fp32 sum ``acc`` (the first one copied). Whether this was the
        step's last micro-batch (``acc`` then holds the whole step's, still scaled: ``unscale_``)."""
        accumulate_fp32([acc], [grad], first=self.micro == 0)
        return self.micro == self.last

    def unscale_(self, sums: Iterable[torch.Tensor]) -> None:
        """fp16: take the loss scale out of a unit's final fp32 ``sums``, before clipping and the optimizer see them."""
        if self.unscale is not None:
            for acc in sums:
                acc.mul_(self.unscale)


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


def take_leaves(tree: Tree, paths: list[str], weights: list[torch.Tensor], on_grad: Callable[[str, torch.Tensor], None]
                ) -> None:
    """Put a unit's ``weights`` into ``tree`` at ``paths`` as leaves that collect gradients: ``on_grad(path, leaf)``
    takes each leaf's gradient as autograd accumulates it (into the trainer's fp32 buffers). The resident trainer's
    units and the 3D trainer's stages take the optimizer's weights this one way."""
    for path, w in zip(paths, weights, strict=True):
        leaf = w.detach().requires_grad_()
        leaf.register_post_accumulate_grad_hook(functools.partial(on_grad, path))
        set_path(tree, path, leaf)


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

    def shard_state(self) -> ShardState: ...  # this process's part of a checkpoint (``train.shard``)

    def load_shard_state(self, entries: dict[str, torch.Tensor]) -> None: ...

    def close(self) -> None: ...


def accumulate_fp32(sums: list[torch.Tensor], grads: list[torch.Tensor], first: bool) -> None:
    """``sums += grads`` (``sums = grads`` when ``first``): fp32 sums of low-precision gradients.

    The streamed trainer compiles it with its blocks: eager's add (and copy) of a bf16 tensor into an
    fp32 one runs an unvectorised mixed-dtype kernel, 28 ms of a 0.86 s gpt2-large step with an
    8-block tail; the compiled loop is one vectorised kernel per tensor.
    """
    for acc, g in zip(sums, grads):
        acc.copy_(g) if first else acc.add_(g)
