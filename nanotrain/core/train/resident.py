"""One optimizer step of fine-tuning under a memory budget, for any model family.

The pieces, each usable on its own, are composed here from outside the model:
- micro-batching: the batch runs as ``batch / micro_batch`` forward+backward passes whose
  gradients add up in fp32 buffers on the device (each micro-batch's loss is divided by the
  whole batch's token count, so the sum is the batch mean);
- bf16 (or any) compute dtype on the device, fp32 master weights in the optimizer; with fp16,
  dynamic loss scaling (``train.scaler``): gradients are unscaled as each unit becomes final and
  a step that overflowed is skipped whole. An overflow may show in any unit, so the units wait for
  the whole backward and its finite check (as clipping's do), or, with the optimizer's
  ``exact_skip``, go over at once and are undone when a later one overflows (a second copy of
  masters and moments in host memory, and slower: docs/BENCHMARKS.md, issue 17);
- recompute per block (``nanotrain.core.recompute``);
- the offloaded AdamW (``nanotrain.core.optim.OffloadAdam``): during the last micro-batch's backward,
  each unit (block, embedding, head) is handed over the moment its gradient is final, so
  the CPU updates it while the GPU goes on with the units below; the next step's forward waits
  for each unit just before it uses it;
- where the units' weights come from and their gradients go, chosen once (``train.step.Weights``):
  ``ResidentWeights``, every unit on the device, or ZeRO-3's, gathered from shards (``data_parallel.zero3``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Callable

import torch

from nanotrain.core.frozen import FrozenBase, trainable
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.core.models import model_spec, run
from nanotrain.core.models.spec import ModelSpec, Unit
from nanotrain.monitor.steptime import StepClock
from nanotrain.core.optim import AdamConfig, OffloadAdam, OffloadConfig
from nanotrain.core.optim.carrier import Carrier
from nanotrain.core.optim.clip_redo import redo
from nanotrain.core.optim.offload import resolve_device
from nanotrain.core.train.clip import clip_, clip_factor, clipped_result
from nanotrain.core.train.scaler import LossScaler
from nanotrain.core.train.result import StepResult
from nanotrain.core.train.step import (HoldsOptimizer, Pass, StepConfig, Weights, batch_denominator, dropout_seed,
                                       micro_batches, take_leaves, unit_reads)
from nanotrain.core.tree import Tree, set_path


@dataclass(frozen=True)
class TrainConfig(StepConfig):
    """The resident trainer's step: ``StepConfig``'s, and the recompute policy (compiling each block only with
    recompute "none"; clipping's cost: ``train.clip``)."""
    recompute: str = "none"        # the policy: none | every | every-K | selective | lean

    def __post_init__(self) -> None:
        super().__post_init__()
        RecomputePolicy.parse(self.recompute)


class HandOver(Enum):
    """When each unit's final gradient goes to the optimizer, and where the step's reported norm comes from.

    =============== ============================================ ================== ================================
    policy          chosen when                                  units go over      the step's norm
    =============== ============================================ ================== ================================
    AT_ONCE         no clipping (fp16: only with exact skips)    as each is final   none
    OPTIMIZER_CLIPS the optimizer clips by itself (data          as each is final   the optimizer's, over the
                    parallelism: the norm of reduced gradients)                     reduced gradients
    SPECULATIVE     clipping, and the optimizer can redo a step  as each is final   summed as they go; a clipped
                    (``optim.clip_redo``)                                           step is redone with the factor
    HELD            clipping otherwise; fp16 without exact       after the whole    ``clip_``'s (fp16 alone: an
                    skips (an overflow may show in any unit)     backward, clipped  infinite threshold, which turns
                                                                 and in backward    an overflow into NaN everywhere
                                                                 order              so the step is skipped whole)
    =============== ============================================ ================== ================================
    """
    AT_ONCE = "at once"
    OPTIMIZER_CLIPS = "optimizer clips"
    SPECULATIVE = "speculative"
    HELD = "held"

    @classmethod
    def choose(cls, opt: Carrier, clip_norm: float | None, fp16_inexact: bool, redoes: bool) -> "HandOver":
        """``fp16_inexact``: fp16, with an optimizer that cannot undo the updates of a step that overflows in a
        later unit (no exact skips); ``redoes``: ``opt`` keeps what ``clip_redo.redo`` needs."""
        if opt.clip_norm is not None:
            return cls.OPTIMIZER_CLIPS
        if clip_norm is not None:
            return cls.SPECULATIVE if redoes else cls.HELD
        return cls.HELD if fp16_inexact else cls.AT_ONCE


def check_fp16_at_once(ocfg: OffloadConfig, tcfg: TrainConfig) -> None:
    """Units handed over as they become final, to an optimizer applied from outside (data parallelism): only
    exact skips undo the updates of a step that overflows in a later unit (or on another rank)."""
    if ocfg.dtype == torch.float16 and not ocfg.exact_skip and tcfg.clip_norm is None:
        raise ValueError("fp16 overflows are expected (the loss scaler finds its scale by them) and may show in "
                         "any rank's unit: use OffloadConfig(exact_skip=True) so that such a step is skipped whole")


class ResidentWeights:
    """Every unit's weights on the device, from the optimizer; gradients summed in its fp32 buffers over the
    micro-batches, each unit handed over as ``HandOver`` says.

    ``make_opt(params, units, adam, ocfg)``: a carrier that keeps every unit on the device (``optim.carrier``;
    the seam through which data parallelism is applied from outside); default an ``OffloadAdam``."""

    def __init__(self, spec: ModelSpec, params: Tree, tcfg: TrainConfig, adam: AdamConfig, ocfg: OffloadConfig,
                 at: Pass, make_opt: Callable[..., Carrier] | None = None):
        if make_opt is not None:
            check_fp16_at_once(ocfg, tcfg)
        self.spec, self.tcfg, self.at = spec, tcfg, at
        self.units, self.unit_of, self.reads = spec.trainable_units(), spec.unit_of(), unit_reads(spec)
        self.frozen = FrozenBase(spec, params, resolve_device(ocfg), ocfg.dtype, ocfg.base_bits)  # under adapters
        self.opt = (make_opt or functools.partial(OffloadAdam, copy=False))(trainable(spec, params), self.units,
                                                                             adam, ocfg)
        self.accum = self.opt.grad_buffers()
        self.block_fn = RecomputePolicy.parse(tcfg.recompute).block_fn(spec, compile=tcfg.compile)
        fp16_inexact = ocfg.dtype == torch.float16 and not ocfg.exact_skip
        # an OffloadAdam of ours with exact skips keeps the state from before the step (``clip_redo``)
        self.hand_over = HandOver.choose(self.opt, tcfg.clip_norm, fp16_inexact, make_opt is None and ocfg.exact_skip)
        self._owed: dict[str, int] = {}
        self._tree: Tree = {}
        self._norms: list[torch.Tensor] = []  # SPECULATIVE: the units' gradient norms, as they go over

    def begin(self) -> None:
        if self.at.micro == 0:
            self._owed = {unit: len(paths) for unit, paths in self.units.items()}
            self._tree = run.empty_tree(self.spec)

    def run(self, unit: Unit, fn: Callable, x: torch.Tensor | None) -> torch.Tensor:
        if self.at.micro == 0:  # the first micro-batch takes each unit's new weights just before it uses them
            self._take(unit.name)
        return fn(self._tree, x)

    def end(self) -> None:
        """Each gradient went to its buffer from its hook."""

    def _take(self, unit: str) -> None:
        """Put ``unit``'s (freshly updated) weights into this step's tree as leaves that collect grads."""
        for path, w in self.frozen.leaves(unit):
            set_path(self._tree, path, w)
        if unit not in self.units:
            return
        self.at.clock.mark("optimizer")  # waiting for the unit's update (and its upload) is the optimizer's time
        weights = self.opt.weights(unit)
        self.at.clock.mark("forward")
        take_leaves(self._tree, self.units[unit], weights, self._on_grad)

    def _on_grad(self, path: str, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        if self.at.accumulate(self.accum[path], grad) and self.hand_over is not HandOver.HELD:
            unit = self.unit_of[path]
            self._owed[unit] -= 1
            if self._owed[unit] == 0:
                grads = [self.accum[p] for p in self.units[unit]]
                if self.hand_over is HandOver.SPECULATIVE:
                    self._norms += [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
                self.opt.update(unit, grads)

    def finish(self) -> torch.Tensor | None:
        if self.hand_over is HandOver.OPTIMIZER_CLIPS:
            return self.opt.grad_norm
        if self.hand_over is HandOver.SPECULATIVE:
            return self._redo_if_clipped()
        if self.hand_over is HandOver.HELD:
            return self._clip_and_hand_over(self.tcfg.clip_norm or math.inf)
        return None

    def _redo_if_clipped(self) -> torch.Tensor:
        """The speculative step's norm (one host sync); when it clips, the step redone with the factor."""
        norms, self._norms = self._norms, []
        norm = torch.stack(norms).square().sum().sqrt()
        factor = clip_factor(norm, self.tcfg.clip_norm)
        if float(factor) < 1:  # NaN (a non-finite norm) is not: the optimizer skipped that step whole
            redo(self.opt, {unit: [self.accum[p] for p in paths] for unit, paths in self.units.items()}, factor)
        return norm

    def _clip_and_hand_over(self, max_norm: float) -> torch.Tensor:
        """Units that waited for the whole backward: scale every gradient (NaN everywhere when the norm is not
        finite, so the optimizer skips the step whole from its first unit), then hand them over in backward
        order (the embeddings last, as without clipping). The global norm before clipping."""
        norm = clip_(list(self.accum.values()), max_norm)
        for unit in reversed(self.units):
            self.opt.update(unit, [self.accum[p] for p in self.units[unit]])
        return norm

    def evaluate(self, unit: Unit, fn: Callable, x: torch.Tensor | None) -> torch.Tensor:
        return fn(run.tree_from(self.spec, (pw for u in self.reads[unit.name] for pw in (
            *self.frozen.leaves(u), *zip(self.units.get(u, ()), self.opt.weights(u) if u in self.units else ())))), x)


class ResidentTrainer(HoldsOptimizer):
    """Holds its units' ``weights`` (and through them the optimizer, which owns masters and states) and runs
    steps on batches.

    ``cfg``: a config of any model family (or its spec). ``params`` (fp32 CPU tensors, as loaded) are
    handed over to the optimizer as its masters, not copied: the caller must not use them afterwards.
    ``weights(spec, params, tcfg, adam, ocfg, at)`` builds the ``Weights``: by default ``ResidentWeights``
    with an ``OffloadAdam``; data parallelism passes its own (``data_parallel.trainer``).
    """

    def __init__(self, cfg: Any, params: Tree, tcfg: TrainConfig, adam: AdamConfig, ocfg: OffloadConfig,
                 weights: Callable[..., Weights] = ResidentWeights):
        self.spec = model_spec(cfg)
        self.cfg, self.tcfg = self.spec.cfg, tcfg
        self.device = resolve_device(ocfg)
        self.scaler = LossScaler() if ocfg.dtype == torch.float16 else None
        self._inv_scale = torch.ones((), dtype=torch.float32, device=self.device)
        self.clock = StepClock(self.device)
        self.at = Pass(self.clock)
        self.weights = weights(self.spec, params, tcfg, adam, ocfg, self.at)
        self.opt = self.weights.opt
        self.step_count = 0
        self.first_micro = 0  # this batch's first micro-batch's index in the global batch (for dropout seeds)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None,
             denom: int | None = None) -> StepResult:
        """Forward+backward over ``tokens``/``targets`` ([batch, seq], on the CPU; packed rows with their
        ``positions``) and the AdamW step.

        ``denom``: the loss's denominator when this batch is one part of a larger one (data
        parallelism: the whole batch's target count); default this batch's."""
        self.clock.start()
        count = batch_denominator(tokens, targets, self.tcfg.batch, self.spec, positions)
        denom = denom or count
        mb = self.tcfg.micro_batch
        self.at.last = self.tcfg.batch // mb - 1
        self.at.unscale = self._inv_scale.copy_(self.scaler.inv_scale()) if self.scaler else None
        if self.scaler:
            skipped_before = self.opt.skipped_steps  # exact: the last step's end waited for its updates
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for micro, (tok, tgt, pos) in enumerate(micro_batches(mb, self.device, tokens, targets, positions)):
            self.at.micro = micro
            self.weights.begin()
            self.clock.mark("forward")
            seed = dropout_seed(self.spec, self.tcfg.dropout_seed, self.step_count, self.first_micro + micro)
            loss = run.run_units(self.spec, {}, tok, tgt, seed=seed, denom=denom, chunk_tokens=self.tcfg.chunk_tokens,
                                 block_fn=self.weights.block_fn, run=self.weights.run, positions=pos)
            self.clock.mark("backward")
            (loss * self.scaler.scale if self.scaler else loss).backward()
            self.clock.mark("optimizer")
            self.weights.end()
            total += loss.detach()
        norm = self.weights.finish()
        self.step_count += 1
        result = clipped_result(total.item(), denom, norm, self.tcfg.clip_norm)
        if self.scaler:  # whether the optimizer skipped the step, its updates waited for (as the next forward would)
            self.opt.synchronize()
            result.skipped = self.opt.skipped_steps > skipped_before
            result = self.scaler.record(result)
        self.clock.mark("end")
        times = self.clock.take()
        del times["copy_wait_s"]  # no phase of its own: the weights' upload is waited for as the optimizer's
        return replace(result, **times)

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> float:
        """The batch's mean loss without gradients or dropout, from the weights the next step would use (each unit's
        from the ``Weights``' ``evaluate`` hook: under ZeRO-3 gathered, which every rank does for as many
        micro-batches)."""
        denom = batch_denominator(tokens, targets, self.tcfg.batch, self.spec, positions)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for tok, tgt, pos in micro_batches(self.tcfg.micro_batch, self.device, tokens, targets, positions):
                total += run.run_units(self.spec, {}, tok, tgt, denom=denom, chunk_tokens=self.tcfg.chunk_tokens,
                                       block_fn=self.weights.block_fn, run=self.weights.evaluate, positions=pos)
        return total.item()
