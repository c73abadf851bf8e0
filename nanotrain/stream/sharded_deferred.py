"""The deferred step of weight streaming under data parallelism: clipping and fp16 with ``--stream --dp``.

With clipping or fp16 the streamed trainer updates no unit before the step's verdict (``stream.deferred``:
the global norm, or an overflow anywhere). Under data parallelism (``sharded.py``) what waits for the
verdict is what each rank's update would use, this rank's shard of the unit's *reduced* gradient:

- backward: the moment a unit's gradient is final (unscaled first with fp16), it is reduce-scattered,
  as the overlapped step does at its update, and this rank's fp32 shard (1/N of the unit) is copied to
  locked host memory on a side stream; the squares of its parameters' pieces (the padding left out)
  are summed on the device. Every unit's shard waits in host memory, the embeddings', the head's
  and the tail's too: 4/N bytes per parameter, where one process keeps 4 per parameter of the
  layer-major blocks (and the rest on the device).
- verdict: the ranks' sums of squares are all-reduced, so every rank reads the same global norm. An
  overflow or NaN on any rank's data reaches some rank's shard through the reduction and makes that
  sum, and so every rank's norm, non-finite: every rank skips the step with nothing applied.
- update pass, in ``stream.deferred``'s order: each shard comes back to the device, is scaled by the
  clip factor, updates this rank's shard of masters and moments, and the new weights are all-gathered,
  as the overlapped step does after its reduce-scatter.

Against the overlapped step: the same collectives, in the same order on every rank (the all-gathers
move to the update pass); the shard travels down and up once more (8/N bytes per parameter).
"""
from __future__ import annotations

from typing import Any

import torch

from nanotrain.data_parallel import comms
from nanotrain.data_parallel.buckets import cut
from nanotrain.stream.kept import KeptGrads, norms


class ShardedKeptGrads(KeptGrads):
    """Every unit's reduced gradient shard on this rank, kept in host memory for one step. ``opt`` (a
    ``stream.sharded.ShardedStreamedAdam``, whose ``kept_grads`` makes this, as ``KeptGrads``' optimizer makes
    it) is asked only for its buckets, its pieces, its group and its two halves of an update, ``reduce`` and
    ``apply``: the keeper stands between them."""

    def __init__(self, opt: Any):
        super().__init__(opt, {b.units[0]: [b.shard] for b in opt.buckets})

    def count(self, unit: str, grads: list[torch.Tensor]) -> None:
        """Under data parallelism every unit's gradient is reduced and kept, not only the blocks'."""
        self.keep(unit, grads)

    def keep(self, unit: str, grads: list[torch.Tensor]) -> None:
        """Reduce-scatter ``unit``'s final gradients ``grads`` (this rank's part of the batch), count this
        rank's shard in the norm and start copying it to host memory."""
        opt = self.opt
        self.reusable()  # the shard buffer's last copy to host memory is done
        shard = opt.reduce(unit, grads)
        self._norms += norms(cut(shard, opt.pieces[unit]))
        self._copy_out(unit, [shard])

    def norm(self) -> torch.Tensor:
        """The global norm: every rank's sum of squares, summed over the group (the same on every rank)."""
        counted, self._norms = self._norms, []
        squares = torch.stack(counted).square().sum().reshape(1)
        comms.sum_async(squares, self.opt.group).wait()
        return squares[0].sqrt()

    def update(self, unit: str, slot, grads: list[torch.Tensor], factor: torch.Tensor | None) -> None:
        """Update this rank's shard of ``unit`` with its kept gradient shard times ``factor`` (``grads``, the
        unit's local gradients, are not used: the shard is their sum over the group)."""
        shard = self.opt.shard_buffer(unit)
        self.bring(unit, [shard])
        if factor is not None:
            shard.mul_(factor)
        self.opt.apply(slot, shard)
