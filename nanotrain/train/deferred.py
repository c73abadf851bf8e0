"""The streamed trainer's deferred step: with clipping or fp16, no unit is updated before the step's verdict.

Without them the streamed trainer updates each unit the moment its backward ends. Clipping needs the
global gradient norm first, and fp16 needs to know that no gradient overflowed (GradScaler's skip is
whole: nothing applied). So with either, the step defers its updates, exactly:

- backward: each layer-major block's fp32 gradient, which shares one device buffer with the other
  blocks, is copied to locked host memory as its backward ends (on a side stream, while the next
  block computes; the buffer is overwritten only after the copy); the tail's, the final norm's and
  the embeddings' gradients have device buffers of their own for the step and stay there. Every
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
The design that keeps the overlap when the norm is under the threshold (update speculatively into a
second copy of masters and moments, redo from the kept gradients when clipping) is in ``train.clip``:
it would cost 12-16 bytes per parameter more host memory, which is what streaming is short of.
"""
from __future__ import annotations

import math

import torch

from nanotrain.memory.pinned import HostArena, WaitClock
from nanotrain.train.clip import clip_factor
from nanotrain.train.step import StepResult


class KeptGrads:
    """Host copies of the layer-major blocks' fp32 gradients for one step, and the step's norms so far."""

    def __init__(self, n_blocks: int, shapes: list[torch.Size], device: torch.device, clock: WaitClock):
        numels = [math.prod(s) for s in shapes]
        self.device, self.clock = device, clock
        self._cuda = device.type == "cuda"
        self.arena = HostArena(HostArena.size_of([(n, torch.float32) for n in numels] * n_blocks), pin=self._cuda)
        self.host = [[self.arena.take(n, torch.float32) for n in numels] for _ in range(n_blocks)]
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._copied: torch.cuda.Event | None = None
        self._norms: list[torch.Tensor] = []

    def count(self, grads: list[torch.Tensor]) -> None:
        """Add final gradients to the step's norm (on the device: no sync)."""
        self._norms += [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]

    def keep(self, block: int, grads: list[torch.Tensor]) -> None:
        """Count ``block``'s final gradients and start copying them to host memory."""
        self.count(grads)
        if not self._cuda:
            for h, g in zip(self.host[block], grads):
                h.copy_(g.view(-1))
            return
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(compute)  # the gradients are final there
            for h, g in zip(self.host[block], grads):
                h.copy_(g.view(-1), non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(self._stream)

    def reusable(self) -> None:
        """Make the compute stream wait until the gradients kept last are copied: their buffers may be reused."""
        self.clock.wait(self._copied)

    def bring(self, block: int, out: list[torch.Tensor]) -> None:
        """Copy ``block``'s kept gradients into ``out`` (device buffers), in order on the compute stream."""
        self.reusable()
        for o, h in zip(out, self.host[block]):
            o.view(-1).copy_(h, non_blocking=True)

    def norm(self) -> torch.Tensor:
        """The global norm of everything counted since the last call (as ``train.clip.global_norm``)."""
        norms, self._norms = self._norms, []
        return torch.stack(norms).square().sum().sqrt()

    def close(self) -> None:
        self.arena.close()


class DeferredSteps:
    """The streamed trainer's side of a deferred step (its slots, buffers, ``kept`` and ``scaler``)."""

    def _final(self, grads: list[torch.Tensor]) -> None:
        """Deferred step: a unit's gradients are final; unscale them (fp16) and count them in the norm."""
        if self.scaler is not None:
            for g in grads:
                g.mul_(self._inv_scale)
        self.kept.count(grads)

    def _final_block(self, i: int, slot) -> None:
        """Deferred step: block ``i``'s gradient is final; unscale it, count it, start copying it out."""
        if self.scaler is not None:
            for g in self.block_grads:
                g.mul_(self._inv_scale)
        self.kept.keep(i, self.block_grads)
        self.opt.release(slot)

    def _apply_deferred(self, grads: dict, factor: torch.Tensor | None) -> None:
        """The deferred step's updates, bottom-up (``train.deferred``), each unit's gradient times ``factor``."""
        opt, below = self.opt, self.first_tail
        scaled = lambda gs: gs if factor is None else [g.mul_(factor) for g in gs]  # noqa: E731
        opt.load("embed", self.embed_slot, states=True)
        opt.update(self.embed_slot, scaled(grads["embed"]))
        if below:
            opt.load("blocks.0", self._block_slot(0), states=True)
        for i in range(below):
            if i + 1 < below:
                opt.load(f"blocks.{i + 1}", self._block_slot(i + 1), states=True)
            self.kept.bring(i, self.block_grads)
            opt.update(self._block_slot(i), scaled(self.block_grads))
        for j, tail_grads in enumerate(self.tail_grads):
            opt.load(f"blocks.{below + j}", self.tail_slot, states=True)
            opt.update(self.tail_slot, scaled(tail_grads))
        opt.update(self.ln_f_slot, scaled(grads["ln_f"]))

    def _verdict(self, grads: dict) -> float:
        """The step's global gradient norm (one host sync); when finite, every unit updated."""
        self.clock.mark("optimizer")
        norm = self.kept.norm()
        value = norm.item()
        if math.isfinite(value):
            clip = self.scfg.clip_norm
            self._apply_deferred(grads, None if clip is None else clip_factor(norm, clip))
        return value

    def _scaled_result(self, result: StepResult, norm: float | None) -> StepResult:
        """The norm, whether it clipped, and (fp16) the scale moved as the resident trainer moves it: an
        overflow with a finite loss at a scale still >= 1 is the scaler finding its scale, no failure."""
        if self.scfg.clip_norm is not None and norm is not None:
            result.grad_norm, result.clipped = norm, norm > self.scfg.clip_norm
        if self.scaler is not None:
            result.loss_scale = self.scaler.scale
            self.scaler.update(result.skipped)
            result.overflow = result.skipped and math.isfinite(result.loss) and self.scaler.scale >= 1
        return result
