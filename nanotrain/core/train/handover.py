"""The one hand-over of units to the optimizer, for every trainer whose units' weights stay on the device.

The resident trainer (``train.resident``), the 3D trainer (``compose.trainer``: the same hand-over walked by a
pipeline schedule) and ZeRO-3 (``data_parallel.zero3``: the last two, for its buckets) do four things with each unit
of theirs, here:

- take: the unit's weights from the optimizer's carrier as leaves of the step's tree that collect gradients
  (``train.step.take_leaves``), waiting for its update (and its upload), which is the optimizer's time;
- sum: each leaf's gradient added into the carrier's fp32 buffer (``grad_buffers``) over the micro-batches, by the
  trainer's own hook (the resident one counts the leaves of the last micro-batch; a pipeline sums in any order);
- final (``final``): once the unit's gradients are all in, as the walk says (the resident trainer: its leaves' last
  micro-batch; a pipeline: its stage's last backward action), what each rank holds only a part of is summed
  (tensor parallelism's ``reduce``), fp16's scale taken out in fp32, and the unit handed over or held, as the
  ``HandOver`` policy says;
- finish (``finish``): the held units handed over, and the step's gradient norm where it is taken.

Where a rank holds only a shard of each unit's gradient (ZeRO-3: a unit is a bucket, its one leaf this rank's shard
of the bucket's fp32 sum, with padding), the trainer says what a leaf's sum is (``accum``), which parts of it the norm
counts (``counted``: the shard's pieces of parameters, not its padding), over which ranks the norm is summed
(``group``), and how a unit goes to its optimizer (``update``).
"""
from __future__ import annotations

import math
from enum import Enum
from typing import Callable

import torch
import torch.distributed as dist

from nanotrain.core.optim.carrier import Carrier
from nanotrain.core.train.clip import clip_
from nanotrain.core.train.step import Pass, take_leaves
from nanotrain.core.tree import Tree

Reduce = Callable[[dict[str, torch.Tensor]], None]  # sums in place, over ranks, what each holds a part of
Update = Callable[[str, list[torch.Tensor]], None]  # a final unit's gradients to the optimizer


class HandOver(Enum):
    """When each unit's final gradient goes to the optimizer, and where the step's reported norm comes from.

    ================= ========================================== ================== ================================
    policy            chosen when                                units go over      the step's norm
    ================= ========================================== ================== ================================
    AT_ONCE           no clipping (fp16: only with exact skips)  as each is final   none
    OPTIMIZER_CLIPS   the optimizer clips by itself (data        as each is final   the optimizer's, over the
                      parallelism: the norm of reduced gradients)                   reduced gradients
    OPTIMIZER_AFTER   the optimizer clips, by a norm over ranks  after the walk,    the optimizer's
                      that may not be taken before the walk ends in the order they
                      (a pipeline's: the whole world's, which    were final
                      no rank may enter while its neighbours
                      still wait for it)
    SPECULATIVE       clipping, and the optimizer can redo a     as each is final   summed as they go; a clipped
                      step (``optim.clip_redo``)                                    step is redone with the factor
    HELD              clipping otherwise; fp16 without exact     after the walk,    ``clip_``'s (fp16 alone: an
                      skips (an overflow may show in any unit)   clipped, in the    infinite threshold, which turns
                                                                 order they were    an overflow into NaN everywhere
                                                                 final              so the step is skipped whole)
    ================= ========================================== ================== ================================
    """
    AT_ONCE = "at once"
    OPTIMIZER_CLIPS = "optimizer clips"
    OPTIMIZER_AFTER = "optimizer clips after the walk"
    SPECULATIVE = "speculative"
    HELD = "held"

    @classmethod
    def choose(cls, opt: Carrier, clip_norm: float | None, fp16_inexact: bool, redoes: bool,
               norm_midway: bool = True) -> "HandOver":
        """``fp16_inexact``: fp16, with an optimizer that cannot undo the updates of a step that overflows in a
        later unit (no exact skips); ``redoes``: ``opt`` keeps what ``clip_redo.redo`` needs; ``norm_midway``: the
        optimizer's norm may be taken before the walk ends (every rank of its group runs the same walk)."""
        if opt.clip_norm is not None:
            return cls.OPTIMIZER_CLIPS if norm_midway else cls.OPTIMIZER_AFTER
        if clip_norm is not None:
            return cls.SPECULATIVE if redoes else cls.HELD
        return cls.HELD if fp16_inexact else cls.AT_ONCE


class UnitHandOver:
    """A trainer's units (name -> leaf paths, in forward order) between the carrier ``opt`` and the step's tree.

    ``at``: where the step stands (its clock; fp16's 1/scale); ``policy``: ``HandOver``; ``clip_norm``: the threshold
    where this side clips (``HELD``, ``SPECULATIVE``); ``reduce``: what a final unit's gradients need summed over
    ranks before they go over (tensor parallelism's partial sums), none by default. Where each rank holds a shard
    (the module docstring): ``accum``, each leaf's fp32 sum (default the carrier's ``grad_buffers``); ``counted``,
    what of them the held units' norm counts and clipping scales (views into them; default all of them);
    ``group``, the ranks that norm is summed over (default none: this rank holds every gradient); ``update``, how
    a unit goes over (default the carrier's ``update``)."""

    def __init__(self, opt: Carrier, units: dict[str, list[str]], at: Pass, policy: HandOver,
                 clip_norm: float | None, reduce: Reduce | None = None, *, accum: dict[str, torch.Tensor] | None = None,
                 counted: list[torch.Tensor] | None = None, group: dist.ProcessGroup | None = None,
                 update: Update | None = None):
        self.opt, self.units, self.at, self.hand_over, self.clip_norm = opt, units, at, policy, clip_norm
        self.reduce, self.counted, self.group, self._update = reduce, counted, group, update
        self.accum = opt.grad_buffers() if accum is None else accum
        self._held: list[str] = []            # HELD, OPTIMIZER_AFTER: the final units, in the order they were
        self._norms: list[torch.Tensor] = []  # SPECULATIVE: the units' gradient norms, as they go over

    def take(self, tree: Tree, unit: str, on_grad: Callable[[str, torch.Tensor], None]) -> None:
        """Put ``unit``'s (freshly updated) weights into ``tree`` as leaves whose gradients ``on_grad`` sums."""
        clock, resume = self.at.clock, self.at.clock.phase
        clock.mark("optimizer")  # waiting for the unit's update (and its upload) is the optimizer's time
        weights = self.opt.weights(unit)
        clock.mark(resume)
        take_leaves(tree, self.units[unit], weights, on_grad)

    def final(self, unit: str) -> None:
        """``unit``'s gradients are all in this step's buffers: reduce and unscale them, then hand them over or hold
        them (``HandOver``)."""
        grads = {p: self.accum[p] for p in self.units[unit]}
        if self.reduce is not None:
            self.reduce(grads)
        self.at.unscale_(grads.values())
        if self.hand_over in (HandOver.HELD, HandOver.OPTIMIZER_AFTER):
            self._held.append(unit)
            return
        if self.hand_over is HandOver.SPECULATIVE:
            self._norms += [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads.values()]
        self._give(unit, list(grads.values()))

    def _give(self, unit: str, grads: list[torch.Tensor]) -> None:
        (self._update or self.opt.update)(unit, grads)  # the carrier's looked up here: a test may stand in for it

    def finish(self) -> torch.Tensor | None:
        """Every unit is final: the held ones handed over; the step's gradient norm, where it is taken."""
        if self.hand_over is HandOver.OPTIMIZER_AFTER:
            self._update_held()
        if self.hand_over in (HandOver.OPTIMIZER_CLIPS, HandOver.OPTIMIZER_AFTER):
            return self.opt.grad_norm
        if self.hand_over is HandOver.SPECULATIVE:  # the trainer redoes a step that clips (its carrier's redo)
            norms, self._norms = self._norms, []
            return torch.stack(norms).square().sum().sqrt()
        if self.hand_over is HandOver.HELD:
            return self._clip_and_hand_over(self.clip_norm or math.inf)
        return None

    def _update_held(self) -> None:
        held, self._held = self._held, []
        for unit in held:
            self._give(unit, [self.accum[p] for p in self.units[unit]])

    def _clip_and_hand_over(self, max_norm: float) -> torch.Tensor:
        """Units that waited for the whole backward: scale every gradient (NaN everywhere when the norm is not
        finite, so the optimizer skips the step whole from its first unit), then hand them over in the order they
        were final (the embeddings last, as without clipping). The global norm before clipping, over ``group``."""
        norm = clip_(list(self.accum.values()) if self.counted is None else self.counted, max_norm, self.group)
        self._update_held()
        return norm
