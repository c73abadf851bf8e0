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
- recompute per block (``nanotrain.memory.recompute``);
- the offloaded AdamW (``nanotrain.optim.OffloadAdam``): during the last micro-batch's backward,
  each unit (block, embedding, head) is handed over the moment its gradient is final, so
  the CPU updates it while the GPU goes on with the units below; the next step's forward waits
  for each unit just before it uses it.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Callable

import torch

from nanotrain.memory.recompute import RecomputePolicy
from nanotrain.models import model_spec, run
from nanotrain.models.spec import Unit
from nanotrain.monitor.steptime import StepClock
from nanotrain.optim import AdamConfig, OffloadAdam, OffloadConfig
from nanotrain.optim.clip_redo import can_redo, redo
from nanotrain.train.clip import clip_, clip_factor, clipped_result
from nanotrain.train.scaler import LossScaler
from nanotrain.train.step import HoldsOptimizer, StepResult, batch_denominator, dropout_seed
from nanotrain.tree import Tree, set_path


@dataclass(frozen=True)
class TrainConfig:
    batch: int = 64
    micro_batch: int = 64
    checkpoint: str = "none"       # the recompute policy: none | every | every-K | selective | lean
    compile: bool = False          # torch.compile each block (only with recompute "none")
    chunk_tokens: int = 2048       # tokens per chunk of the fused LM-head loss
    dropout_seed: int = 0          # dropout masks are a function of (this, step, micro-batch, block)
    clip_norm: float | None = None  # clip gradients to this global norm (exact; see train.clip for the cost)

    def __post_init__(self) -> None:
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip norm {self.clip_norm} must be > 0")
        if self.batch < 1 or self.micro_batch < 1 or self.batch % self.micro_batch:
            raise ValueError(f"batch {self.batch} is not divisible by micro-batch {self.micro_batch}; "
                             f"pick a micro-batch that divides it (e.g. "
                             f"{', '.join(str(d) for d in range(1, self.batch + 1) if self.batch % d == 0)})")
        RecomputePolicy.parse(self.checkpoint)


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
    def choose(cls, opt: Any, clip_norm: float | None, fp16_inexact: bool) -> "HandOver":
        """``fp16_inexact``: fp16, with an optimizer that cannot undo the updates of a step that overflows in a
        later unit (no exact skips)."""
        if opt.clip_norm is not None:
            return cls.OPTIMIZER_CLIPS
        if clip_norm is not None:
            return cls.SPECULATIVE if can_redo(opt) else cls.HELD
        return cls.HELD if fp16_inexact else cls.AT_ONCE


class ResidentTrainer(HoldsOptimizer):
    """Holds the optimizer (which owns weights and states) and runs steps on batches.

    ``cfg``: a config of any model family (or its spec). ``params`` (fp32 CPU tensors, as loaded) are
    handed over to the optimizer as its masters, not copied: the caller must not use them afterwards.
    """

    def __init__(self, cfg: Any, params: Tree, tcfg: TrainConfig, adam: AdamConfig, ocfg: OffloadConfig,
                 make_opt: Callable[..., OffloadAdam] | None = None):
        self.spec = model_spec(cfg)
        self.cfg, self.tcfg = self.spec.cfg, tcfg
        self.policy = RecomputePolicy.parse(tcfg.checkpoint)
        self.units = self.spec.unit_dict()
        self.unit_of = self.spec.unit_of()
        # ``make_opt(params, units, adam, ocfg)``: an optimizer with OffloadAdam's per-unit interface
        # (the seam through which data parallelism is applied from outside; nanotrain.data_parallel).
        self.opt = (make_opt or functools.partial(OffloadAdam, copy=False))(params, self.units, adam, ocfg)
        self.device = self.opt.device
        self.accum = self.opt.grad_buffers()
        self.block_fn = self.policy.block_fn(self.spec, compile=tcfg.compile)
        self.step_count = 0
        self.first_micro = 0  # this batch's first micro-batch's index in the global batch (for dropout seeds)
        self._micro, self._last_micro = 0, 0
        self._owed: dict[str, int] = {}
        self.scaler = LossScaler() if ocfg.dtype == torch.float16 else None
        if self.scaler and not ocfg.exact_skip and tcfg.clip_norm is None and make_opt is not None:
            raise ValueError("fp16 overflows are expected (the loss scaler finds its scale by them) and may show in "
                             "any rank's unit: use OffloadConfig(exact_skip=True) so that such a step is skipped whole")
        self._inv_scale = torch.ones((), dtype=torch.float32, device=self.device)
        self.clock = StepClock(self.device)
        self.hand_over = HandOver.choose(self.opt, tcfg.clip_norm, self.scaler is not None and not ocfg.exact_skip)
        self._norms: list[torch.Tensor] = []  # SPECULATIVE: the units' gradient norms, as they go over

    # -- gradients: accumulate in fp32, hand each unit over as soon as it is final ----------------

    def _on_grad(self, path: str, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        acc = self.accum[path]
        if self._micro == 0:
            acc.copy_(grad)
        else:
            acc.add_(grad)
        if self._micro == self._last_micro and self.scaler:
            acc.mul_(self._inv_scale)  # final: unscaled in fp32 before clipping and the optimizer
        if self._micro == self._last_micro and self.hand_over is not HandOver.HELD:
            unit = self.unit_of[path]
            self._owed[unit] -= 1
            if self._owed[unit] == 0:
                grads = [self.accum[p] for p in self.units[unit]]
                if self.hand_over is HandOver.SPECULATIVE:
                    self._norms += [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
                self.opt.grads_ready(unit, grads)

    def _take(self, tree: Tree, unit: str) -> None:
        """Put ``unit``'s (freshly updated) weights into this step's tree as leaves that collect grads."""
        self.clock.mark("optimizer")  # waiting for the unit's update (and its upload) is the optimizer's time
        weights = self.opt.wait_params(unit)
        self.clock.mark("forward")
        for path, w in zip(self.units[unit], weights):
            leaf = w.detach().requires_grad_()
            leaf.register_post_accumulate_grad_hook(lambda t, path=path: self._on_grad(path, t))
            set_path(tree, path, leaf)

    # -- one step ---------------------------------------------------------------------------

    def _seed(self, micro: int) -> int | None:
        return dropout_seed(self.spec, self.tcfg.dropout_seed, self.step_count, self.first_micro + micro)

    def _micro_loss(self, tree: Tree, tokens: torch.Tensor, targets: torch.Tensor, denom: int,
                    first: bool) -> torch.Tensor:
        def fresh(unit: Unit, fn: Callable, x: torch.Tensor | None) -> torch.Tensor:
            if first:  # the first micro-batch takes each unit's new weights just before it uses them
                self._take(tree, unit.name)
            return fn(tree, x)

        return run.run_units(self.spec, tree, tokens, targets, seed=self._seed(self._micro), denom=denom,
                             chunk_tokens=self.tcfg.chunk_tokens, block_fn=self.block_fn, run=fresh)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, denom: int | None = None) -> StepResult:
        """Forward+backward over ``tokens``/``targets`` ([batch, seq], on the CPU) and the AdamW step.

        ``denom``: the loss's denominator when this batch is one part of a larger one (data
        parallelism: the whole batch's target count); default this batch's."""
        self.clock.start()
        count = batch_denominator(tokens, targets, self.tcfg.batch, self.spec)
        denom = denom or count
        n_micro = self.tcfg.batch // self.tcfg.micro_batch
        self._last_micro = n_micro - 1
        self._owed = {unit: len(paths) for unit, paths in self.units.items()}
        tree = run.empty_tree(self.spec)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        pin = self.device.type == "cuda"
        mb = self.tcfg.micro_batch
        if self.scaler:
            self._inv_scale.copy_(self.scaler.inv_scale())
            skipped_before = self.opt.skipped_steps  # exact: the last step's end waited for its updates
        for micro, (tok, tgt) in enumerate(zip(tokens.split(mb), targets.split(mb))):
            self._micro = micro
            if pin:
                tok, tgt = tok.pin_memory(), tgt.pin_memory()
            tok, tgt = tok.to(self.device, non_blocking=True), tgt.to(self.device, non_blocking=True)
            loss = self._micro_loss(tree, tok, tgt, denom, first=micro == 0)
            self.clock.mark("backward")
            (loss * self.scaler.scale if self.scaler else loss).backward()
            total += loss.detach()
            self.clock.mark("forward")
        self.clock.mark("optimizer")
        norm = None
        if self.hand_over is HandOver.OPTIMIZER_CLIPS:
            norm = self.opt.grad_norm
        elif self.hand_over is HandOver.SPECULATIVE:
            norm = self._redo_if_clipped()
        elif self.hand_over is HandOver.HELD:
            norm = self._clip_and_hand_over(self.tcfg.clip_norm or math.inf)
            norm = norm if self.tcfg.clip_norm is not None else None  # fp16's finite check reports no norm
        self.step_count += 1
        result = clipped_result(total.item(), denom, norm, self.tcfg.clip_norm)
        result = result if self.scaler is None else self.scaler.settle(result, self.opt, skipped_before)
        self.clock.mark("end")
        times = self.clock.take()
        del times["copy_wait_s"]  # no phase of its own: the weights' upload is waited for as the optimizer's
        return replace(result, **times)

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
            self.opt.grads_ready(unit, [self.accum[p] for p in self.units[unit]])
        return norm

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The batch's mean loss without gradients or dropout, from the weights the next step would use."""
        denom = batch_denominator(tokens, targets, self.tcfg.batch, self.spec)
        tree = run.empty_tree(self.spec)
        for unit, paths in self.units.items():
            for path, w in zip(paths, self.opt.wait_params(unit)):
                set_path(tree, path, w)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for tok, tgt in zip(tokens.split(self.tcfg.micro_batch), targets.split(self.tcfg.micro_batch)):
                total += run.run_units(self.spec, tree, tok.to(self.device), tgt.to(self.device), denom=denom,
                                       chunk_tokens=self.tcfg.chunk_tokens, block_fn=self.block_fn)
        return total.item()

    def close(self) -> None:
        self.opt.close()
