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

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from nanotrain.core.frozen import FrozenBase, trainable
from nanotrain.core.leaves import Start, as_leaves
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.core.models import model_spec, run
from nanotrain.core.models.spec import ModelSpec, Unit
from nanotrain.monitor.steptime import StepClock
from nanotrain.core.optim import AdamConfig, OffloadAdam, OffloadConfig
from nanotrain.core.optim.carrier import Carrier
from nanotrain.core.optim.clip_redo import redo
from nanotrain.core.optim.offload import resolve_device
from nanotrain.core.optim.units import masters_home
from nanotrain.core.train.clip import clip_factor, clipped_result
from nanotrain.core.train.handover import HandOver, UnitHandOver
from nanotrain.core.train.scaler import LossScaler
from nanotrain.core.train.result import StepResult
from nanotrain.core.train.step import (HoldsOptimizer, Pass, StepConfig, Weights, batch_denominator, dropout_seed,
                                       micro_batches, unit_reads)
from nanotrain.core.tree import Tree, set_path


@dataclass(frozen=True)
class TrainConfig(StepConfig):
    """The resident trainer's step: ``StepConfig``'s, and the recompute policy (compiling each block only with
    recompute "none"; clipping's cost: ``train.clip``)."""
    recompute: str = "none"        # the policy: none | every | every-K | selective | lean

    def __post_init__(self) -> None:
        super().__post_init__()
        RecomputePolicy.parse(self.recompute)


def check_fp16_at_once(ocfg: OffloadConfig, tcfg: TrainConfig) -> None:
    """Units handed over as they become final, to an optimizer applied from outside (data parallelism): only
    exact skips undo the updates of a step that overflows in a later unit (or on another rank)."""
    if ocfg.dtype == torch.float16 and not ocfg.exact_skip and tcfg.clip_norm is None:
        raise ValueError("fp16 overflows are expected (the loss scaler finds its scale by them) and may show in "
                         "any rank's unit: use OffloadConfig(exact_skip=True) so that such a step is skipped whole")


class ResidentWeights(UnitHandOver):
    """Every unit's weights on the device, from the optimizer; gradients summed in its fp32 buffers over the
    micro-batches, each unit final once its leaves' last micro-batch's gradients are in, and handed over as
    ``HandOver`` says (``train.handover``).

    ``make_opt(leaves, units, adam, ocfg)``: a carrier that keeps every unit on the device (``optim.carrier``;
    the seam through which data parallelism is applied from outside), taking ``units``' leaves as it reads them;
    default an ``OffloadAdam`` of the trainable leaves read into a tree."""

    def __init__(self, spec: ModelSpec, params: Start, tcfg: TrainConfig, adam: AdamConfig, ocfg: OffloadConfig,
                 at: Pass, make_opt: Callable[..., Carrier] | None = None):
        if make_opt is not None:
            check_fp16_at_once(ocfg, tcfg)
        self.spec, self.tcfg = spec, tcfg
        self.unit_of, self.reads = spec.unit_of(), unit_reads(spec)
        leaves = as_leaves(params)
        self.frozen = FrozenBase(spec, leaves, resolve_device(ocfg), ocfg.dtype, ocfg.base_bits)  # under adapters
        units = spec.trainable_units()
        opt = (make_opt(leaves, units, adam, ocfg) if make_opt else
               OffloadAdam(trainable(spec, leaves, masters_home(ocfg)), units, adam, ocfg, copy=False))
        self.block_fn = RecomputePolicy.parse(tcfg.recompute).block_fn(spec, compile=tcfg.compile)
        fp16_inexact = ocfg.dtype == torch.float16 and not ocfg.exact_skip
        # an OffloadAdam of ours with exact skips keeps the state from before the step (``clip_redo``)
        policy = HandOver.choose(opt, tcfg.clip_norm, fp16_inexact, make_opt is None and ocfg.exact_skip)
        super().__init__(opt, units, at, policy, tcfg.clip_norm)
        self._owed: dict[str, int] = {}
        self._tree: Tree = {}

    def begin(self) -> None:
        if self.at.micro == 0:
            self._owed = {unit: len(paths) for unit, paths in self.units.items()}
            self._tree = run.empty_tree(self.spec)

    def run(self, unit: Unit, fn: Callable, x: torch.Tensor | None) -> torch.Tensor:
        if self.at.micro == 0:  # the first micro-batch takes each unit's new weights just before it uses them
            for path, w in self.frozen.leaves(unit.name):
                set_path(self._tree, path, w)
            if unit.name in self.units:
                self.take(self._tree, unit.name, self._on_grad)
        return fn(self._tree, x)

    def end(self) -> None:
        """Each gradient went to its buffer from its hook."""

    def _on_grad(self, path: str, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        if self.at.accumulate(self.accum[path], grad):
            unit = self.unit_of[path]
            self._owed[unit] -= 1
            if self._owed[unit] == 0:
                self.final(unit)

    def finish(self) -> torch.Tensor | None:
        norm = super().finish()
        if self.hand_over is HandOver.SPECULATIVE:
            self._redo_if_clipped(norm)
        return norm

    def _redo_if_clipped(self, norm: torch.Tensor) -> None:
        """When the speculative step's norm (one host sync) clips, our ``OffloadAdam`` redoes it with the factor."""
        factor = clip_factor(norm, self.tcfg.clip_norm)
        if float(factor) < 1:  # NaN (a non-finite norm) is not: the optimizer skipped that step whole
            redo(self.opt, {unit: [self.accum[p] for p in paths] for unit, paths in self.units.items()}, factor)

    def evaluate(self, unit: Unit, fn: Callable, x: torch.Tensor | None) -> torch.Tensor:
        return fn(run.tree_from(self.spec, (pw for u in self.reads[unit.name] for pw in (
            *self.frozen.leaves(u), *zip(self.units.get(u, ()), self.opt.weights(u) if u in self.units else ())))), x)


class ResidentTrainer(HoldsOptimizer):
    """Holds its units' ``weights`` (and through them the optimizer, which owns masters and states) and runs
    steps on batches.

    ``cfg``: a config of any model family (or its spec). ``params``: a tree of fp32 CPU tensors, handed over to the
    optimizer as its masters, not copied (the caller must not use them afterwards), or leaves read as taken
    (``core.leaves``: a frozen base's go to the device one at a time).
    ``weights(spec, params, tcfg, adam, ocfg, at)`` builds the ``Weights``: by default ``ResidentWeights``
    with an ``OffloadAdam``; data parallelism passes its own (``data_parallel.trainer``).
    """

    def __init__(self, cfg: Any, params: Start, tcfg: TrainConfig, adam: AdamConfig, ocfg: OffloadConfig,
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
        skipped_before = self.opt.skipped_steps  # exact with fp16: the last step's end waited for its updates
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
        result = self.scaled_result(clipped_result(total.item(), denom, norm, self.tcfg.clip_norm), skipped_before)
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
