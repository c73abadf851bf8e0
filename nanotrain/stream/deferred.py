"""The streamed trainer's deferred step: with clipping or fp16, no unit is updated before the step's verdict.

Without them the streamed trainer updates each unit the moment its backward ends. Clipping needs the
global gradient norm first, and fp16 needs to know that no gradient overflowed (GradScaler's skip is
whole: nothing applied). So with either, the step defers its updates, exactly:

- backward: each layer-major block's fp32 gradient, which shares one device buffer with the other
  blocks, is copied to locked host memory as its backward ends (on a side stream, while the next
  block computes; the buffer is overwritten only after the copy); the tail's, the head's and the
  embedding's gradients have device buffers of their own for the step and stay there. Every
  unit's gradient norm is taken on the device as it becomes final; with fp16 the gradients are
  unscaled first. The backward carries no moments (nothing is updated during it).
- verdict: one host sync reads the global norm. Not finite (an fp16 overflow, or a NaN): the step is
  skipped with nothing applied. Else:
- update pass, bottom-up: each unit's masters and moments are loaded (the next block's prefetched
  while this one updates), its gradient brought back (blocks) and scaled by the clip factor, and it
  is updated and written back as in the overlapped step.

Cost against the overlapped step, by construction (not measured here): host memory 4 bytes per
parameter of the layer-major blocks (locked; 2.8 GB for gpt2-large); per block 12 more bytes per
parameter over the bus (its gradient down and up, its masters up once more); and the updates, which
otherwise hide under the backward, run after it, with the gradients' upload on the compute stream.
The resident trainer's way of keeping the overlap (``train.clip``: update speculatively into a second copy
of masters and moments, redo from the kept gradients when clipping) would cost 12-16 bytes per parameter
more host memory here, which is what streaming is short of.

Under data parallelism what waits is each unit's reduced gradient shard, 1/N of it per rank, and the
norm is summed over the ranks (``stream.sharded_deferred``).
"""
from __future__ import annotations

import math

import torch

from nanotrain.core.train.clip import clip_factor
class DeferredSteps:
    """The streamed trainer's side of a deferred step (its slots, buffers, ``kept`` and ``scaler``)."""

    def _unscale(self, grads: list[torch.Tensor]) -> None:
        if self.scaler is not None:
            for g in grads:
                g.mul_(self._inv_scale)

    def _final(self, unit: str, grads: list[torch.Tensor]) -> None:
        """Deferred step: ``unit``'s gradients are final; unscale them (fp16) and count them in the norm."""
        self._unscale(grads)
        self.kept.count(unit, grads)

    def _final_head(self, head_grads: list[torch.Tensor]) -> None:
        """Deferred step: the head unit's and the tail's gradients are final (after the head)."""
        self._final(self.spec.head_unit.name, head_grads)
        for j, grads in enumerate(self.tail_grads):
            self._final(self.block_names[self.first_tail + j], grads)

    def _final_block(self, i: int, slot) -> None:
        """Deferred step: block ``i``'s gradient is final; unscale it, count it, start copying it out."""
        self._unscale(self.block_grads)
        self.kept.keep(self.block_names[i], self.block_grads)
        self.opt.release(slot)

    def _apply_deferred(self, grads: dict[str, torch.Tensor], factor: torch.Tensor | None) -> None:
        """The deferred step's updates, bottom-up (``stream.deferred``), each unit's gradient times ``factor``.
        ``grads``: the embedding's and the head's fp32 gradients, by leaf path."""
        opt, below, update, names = self.opt, self.first_tail, self.kept.update, self.block_names
        embed, head = self.spec.embed_unit, self.spec.head_unit
        embed_grads, head_grads = ([grads[p] for p in unit.paths if p in grads] for unit in (embed, head))
        if embed_grads:  # none when frozen (a base under adapters), as the head's
            opt.fetch(embed.name, self.embed_slot, states=True)
            update(embed.name, self.embed_slot, embed_grads, factor)
        if below:
            opt.fetch(names[0], self._block_slot(0), states=True)
        for i in range(below):
            if i + 1 < below:
                opt.fetch(names[i + 1], self._block_slot(i + 1), states=True)
            update(names[i], self._block_slot(i), self.block_grads, factor)
        for j, tail_grads in enumerate(self.tail_grads):
            opt.fetch(names[below + j], self.tail_slot, states=True)
            update(names[below + j], self.tail_slot, tail_grads, factor)
        if head_grads:
            update(head.name, self.head_slot, head_grads, factor)

    def _verdict(self, grads: dict[str, torch.Tensor]) -> float:
        """The step's global gradient norm (one host sync); when finite, every unit updated."""
        self.clock.mark("optimizer")
        norm = self.kept.norm()
        value = norm.item()
        if math.isfinite(value):
            clip = self.scfg.clip_norm
            self._apply_deferred(grads, None if clip is None else clip_factor(norm, clip))
        return value
