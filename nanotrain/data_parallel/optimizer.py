"""The data-parallel optimizer: the trainer's optimizer seam, with gradients reduced as they become final.

``DataParallelAdam`` has the interface ``ResidentTrainer`` uses (``grad_buffers``,
``update``, ``weights``, ``params``, ``device``, ``state_dict``, ...) and holds a
``ShardedAdam`` (``shards.py``) that does the update. Parameters are grouped into buckets
(``buckets.py``); the trainer accumulates each parameter's gradient in a view into its bucket's
flat fp32 buffer. The 3D engine hands it each pipeline stage's leaves as a unit, the same way
(``compose.trainer``).

- When the last unit of a bucket hands over its final gradient (``update``, during the last
  micro-batch's backward), the bucket's reduction is launched at once, so it runs while backward
  goes on with the units below. On CUDA with states in host memory the reduced gradient is handed
  to the inner optimizer at once, on a side stream that waits for the collective, without blocking
  the host; otherwise (CPU, or an update on the device, which reads an inf/NaN flag on the host)
  a finished reduction is handed over at the next ``update``, and the last bucket waits for all.
- The reduction is a sum: each rank's loss is divided by the *global* batch's token count
  (``DataParallelTrainer`` does it), so the sum over ranks is the gradient of the whole batch's
  mean loss, bit for bit the quantity one process would compute (up to summation order).
  ``reduce_dtype=torch.bfloat16`` sends half the bytes and sums in bf16.

``zero`` picks what each rank keeps:
- 0 (DDP): the whole gradient is summed on every rank and every rank runs the whole update.
- 1: optimizer state sharded. The gradient is summed in full, but each rank's inner optimizer
  holds masters and moments of its shard of every bucket only (cut at the parameters' bounds:
  ``shards.py``), updates that shard, and the new shards are all-gathered into the full device
  weights just before the next forward uses them (in ``weights``, the next bucket's gathering
  started ahead).
- 2: as 1, but the gradient is reduce-scattered: each rank receives only its shard of the sum
  (half the traffic of an all-reduce). The fp32 accumulation buffer over micro-batches stays whole,
  as in Megatron's distributed optimizer.

With ZeRO a rank checks only its shard for inf/NaN, so a bucket whose gradient is not finite on
any rank is turned all-NaN before it is sent: every rank then sees it and skips the step alike
(which is also what makes fp16's loss scaler back off on every rank at once).

``clip_norm``: the global norm is taken over the *reduced* gradients, each parameter once (DDP:
the whole sum, on every rank alike; ZeRO: each rank's shard without its padding, the squares
summed over the group), so the reductions still overlap backward but the updates wait for the last.
A caller whose ranks hold other parts of the model too (the 3D trainer) gives the norm (``norm``).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from nanotrain.data_parallel import comms
from nanotrain.data_parallel.buckets import Bucket, cut, plan_buckets, sentinels, spread_nonfinite
from nanotrain.data_parallel.config import DPConfig
from nanotrain.data_parallel.shards import ShardedAdam
from nanotrain.core.train.shard import TP, Piece, ShardState, moment_block
from nanotrain.distributed import Group
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.optim.carrier import Wraps
from nanotrain.core.optim.offload import resolve_device
from nanotrain.core.train.clip import clip_factor, global_norm
from nanotrain.core.leaves import Start, as_leaves


class DataParallelAdam(Wraps):
    """AdamW over ``params`` replicated (``zero=0``) or sharded (1, 2) over the data-parallel ``group``.

    ``params``: the leaves of ``units`` (``core.leaves``), each read once, in ``units``' order, as the group's first
    rank has it, and cut at once to what this rank keeps (``shards.take``); or a tree they are taken from (leaves this
    rank does not hold are None). With ``clip_norm`` the reduced gradients are clipped to that
    global norm (before clipping: ``grad_norm``, a tensor, once the last unit is handed over);
    ``ResidentTrainer`` then leaves it to us. ``norm``: that norm from this rank's reduced pieces, each with the
    ``Piece`` it is (default: over the data-parallel group, each parameter once).
    """

    def __init__(self, params: Start, units: dict[str, list[str]], hp: AdamConfig, ocfg: OffloadConfig,
                 group: Group, dcfg: DPConfig, copy: bool = True, clip_norm: float | None = None,
                 norm: Callable[[list[tuple[Piece, torch.Tensor]]], torch.Tensor] | None = None):
        self.group, self.dcfg, self.clip_norm = group, dcfg, clip_norm
        self.norm = norm or self._group_norm
        self.grad_norm: torch.Tensor | None = None
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = resolve_device(ocfg)
        self._cuda = self.device.type == "cuda"
        leaves = as_leaves(params)
        sharded = dcfg.zero > 0
        shapes = {path: torch.Size(leaves.shapes[path]) for paths in units.values() for path in paths}
        self.buckets = plan_buckets(units, shapes, int(dcfg.bucket_mb * 2**18), self.world if sharded else 1,
                                    (moment_block(ocfg) or 1) if sharded else 1)
        self._bucket_of = {u: b for b in self.buckets for u in b.units}
        self._sentinels = {b.name: sentinels(b, self.device) for b in self.buckets} if sharded else {}
        self._units = units
        self._grads = {b.name: torch.zeros(b.padded, device=self.device) for b in self.buckets}
        self._low = ({b.name: torch.empty(b.padded, dtype=dcfg.reduce_dtype, device=self.device)
                      for b in self.buckets} if dcfg.reduce_dtype != torch.float32 else {})
        if sharded:  # the whole device weights, flat per bucket, that each bucket's shards are gathered into
            self._weights = {b.name: torch.zeros(b.padded, dtype=ocfg.dtype, device=self.device) for b in self.buckets}
            self._views = {p: v for b in self.buckets for p, v in b.views(self._weights[b.name]).items()}
        self.inner = ShardedAdam(leaves, units, self.buckets, hp, ocfg, group, sharded, copy=copy,
                                 whole=self._views if sharded else None)  # each leaf written there as it passes
        if not sharded:  # the inner optimizer's device weights are the whole parameters
            self._views = {p.path: w.view(b.shape(p.path)) for b, pieces in self.inner.layout
                           for p, w in zip(pieces, self.inner.weights(b))}
        if dcfg.zero == 2:
            self._grad_shard = {b.name: torch.empty(b.shard, device=self.device) for b in self.buckets}
            self._low_shard = {b.name: torch.empty(b.shard, dtype=dcfg.reduce_dtype, device=self.device)
                               for b in self.buckets} if self._low else {}
        self._side = torch.cuda.Stream(self.device) if self._cuda else None
        # Hand a reduced bucket over as soon as it is launched (ordered on the side stream) when the
        # inner optimizer does not block the host; an update on the device does (it reads the
        # inf/NaN flag), and would then hold backward up until the reduction ends: poll instead.
        self._eager = self._cuda and ocfg.offload
        self._done: dict[str, torch.cuda.Event] = {}     # bucket handed over (CUDA): buffers free again
        self._ready: dict[str, set[str]] = {b.name: set() for b in self.buckets}
        self._pending: list[tuple[Bucket, comms.Work]] = []
        self._launched = 0
        self._stale: set[str] = set()                     # buckets whose updated shards are not gathered
        self._gathering: dict[str, comms.Work] = {}

    def grad_buffers(self) -> dict[str, torch.Tensor]:
        """Where the trainer accumulates each parameter's gradient: views into the buckets' flat buffers."""
        return {p: v for b in self.buckets for p, v in b.views(self._grads[b.name]).items()}

    def reduced(self, b: Bucket) -> torch.Tensor:
        """This rank's part of ``b``'s last reduced gradient, as its optimizer got it (DDP: the whole sum)."""
        if self.dcfg.zero == 2:
            return self._grad_shard[b.name]
        return self._grads[b.name][slice(*b.shard_range(self.rank))] if self.dcfg.zero else self._grads[b.name]

    # -- gradients: reduce each bucket as soon as it is complete -------------------------------

    def update(self, unit: str, grads: list[torch.Tensor]) -> None:
        """``unit``'s final local gradients (in the order of its paths); normally the views of ``grad_buffers``."""
        b = self._bucket_of[unit]
        if unit in self._ready[b.name]:
            raise RuntimeError(f"unit {unit!r} already got its gradients this step")
        views = b.views(self._grads[b.name])
        for path, g in zip(self._units[unit], grads, strict=True):
            if g.data_ptr() != views[path].data_ptr():
                views[path].copy_(g)
        self._ready[b.name].add(unit)
        if len(self._ready[b.name]) == len(b.units):
            self._launch(b)
        last = self._launched == len(self.buckets)
        if self.clip_norm is None:
            self._hand_over(wait=last)
        elif last:
            self._clip_and_hand_over()
        if last:
            self._launched = 0
            self._ready = {b.name: set() for b in self.buckets}

    def _launch(self, b: Bucket) -> None:
        flat = self._grads[b.name]
        if self.dcfg.zero:  # one rank's inf/NaN must reach every rank's shard (the padding too: cleared first)
            flat[b.numel:].zero_()
            spread_nonfinite(flat, self._sentinels[b.name])
        send = self._low[b.name].copy_(flat) if self._low else flat
        if self.dcfg.zero == 2:
            out = self._low_shard[b.name] if self._low else self._grad_shard[b.name]
            work = comms.reduce_scatter_async(out, send, self.group)
        else:
            work = comms.sum_async(send, self.group)
        self._pending.append((b, work))
        self._launched += 1

    def _hand_over(self, wait: bool) -> None:
        """Give the inner optimizer every reduced bucket: all when ``wait`` (or eager), else those finished."""
        while self._pending and (wait or self._eager or self._pending[0][1].is_completed()):
            b, work = self._pending.pop(0)
            if self._cuda:
                with torch.cuda.stream(self._side):
                    self._give(b, self._reduced(b, work))
                    self._done[b.name] = torch.cuda.Event()
                    self._done[b.name].record(self._side)
            else:
                self._give(b, self._reduced(b, work))

    def _reduced(self, b: Bucket, work: comms.Work) -> torch.Tensor:
        """Once ``b``'s reduction ends: what this rank updates from (the whole sum, or its shard), in fp32."""
        work.wait()
        if self._low:
            low = self._low_shard[b.name] if self.dcfg.zero == 2 else self._low[b.name]
            (self._grad_shard[b.name] if self.dcfg.zero == 2 else self._grads[b.name]).copy_(low)
        return self.reduced(b)

    def _give(self, b: Bucket, reduced: torch.Tensor) -> None:
        self.inner.update(b, reduced)
        if self.dcfg.zero:
            self._stale.add(b.name)

    def _clip_and_hand_over(self) -> None:
        """Every bucket's reduction ended (waited for on the current stream): clip, then hand all over."""
        reduced = [(b, self._reduced(b, work)) for b, work in self._pending]
        self._pending = []
        self.grad_norm = self.norm([(p, t) for b, r in reduced
                                    for p, t in zip(self.inner.pieces[b.name], cut(r, self.inner.pieces[b.name]))])
        factor = clip_factor(self.grad_norm, self.clip_norm)
        for b, r in reduced:
            self._give(b, r.mul_(factor))

    def _group_norm(self, pieces: list[tuple[Piece, torch.Tensor]]) -> torch.Tensor:
        """DDP: every rank holds the same whole sum; ZeRO: each its shard, the squares summed over the group (a rank
        holding no piece counts an empty one)."""
        return global_norm([t for _, t in pieces] or [torch.zeros(0, device=self.device)],
                           self.group if self.dcfg.zero else None)

    # -- weights: gather updated shards just before use --------------------------------------

    def weights(self, unit: str) -> list[torch.Tensor]:
        """``unit``'s device weights (in the order of its paths), safe to use on the current stream."""
        b = self._bucket_of[unit]
        if b.name in self._done:  # the gradient buffers may be written again after this
            torch.cuda.current_stream(self.device).wait_event(self._done.pop(b.name))
        if not self.dcfg.zero:
            self.inner.weights(b)  # the update of its bucket is done (the views are the inner weights)
            return [self._views[p] for p in self._units[unit]]
        self._gather(b)
        following = self.buckets.index(b) - 1  # forward runs the buckets in reverse
        if following >= 0:
            self._gather(self.buckets[following])
        if b.name in self._gathering:
            self._gathering.pop(b.name).wait()
        views = b.views(self._weights[b.name])
        return [views[p] for p in self._units[unit]]

    def _gather(self, b: Bucket) -> None:
        if b.name in self._stale:
            self._stale.discard(b.name)
            self._gathering[b.name] = comms.all_gather_async(self._weights[b.name], self.inner.new_shard(b),
                                                             self.group)

    def synchronize(self) -> None:
        self._hand_over(wait=True)
        self.inner.synchronize()

    def check_replicas(self) -> None:
        """Raise if any rank's device weights differ from the first rank's (debug: costs a broadcast)."""
        for b in self.buckets:
            for unit in reversed(b.units):
                for path, w in zip(self._units[unit], self.weights(unit)):
                    if comms.differs_from_first(w.contiguous().view(-1), self.group):
                        raise RuntimeError(f"data-parallel replicas differ: {path!r} on some rank is not the "
                                           f"first rank's")

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The single-process optimizer's ``state_dict`` (the same keys and layout). With ZeRO the shards
        are gathered (collective: every rank calls it) and the whole state is returned on the group's
        first rank only; the others get ``{}``."""
        self.synchronize()
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load a single-process ``state_dict`` (the same on every rank), saved at any world size."""
        self.synchronize()
        self.inner.load_state_dict(sd)
        self._stale = {b.name for b in self.buckets} if self.dcfg.zero else set()

    def shard_state(self, tp: TP = None) -> ShardState:
        """This rank's pieces of masters and moments (``slices.py``; under DDP the first rank writes them)."""
        self.synchronize()
        return self.inner.shard_state(tp)

    def load_shard_state(self, entries: dict[str, torch.Tensor]) -> None:
        self.synchronize()
        self.inner.load_shard_state(entries)
        self._stale = {b.name for b in self.buckets} if self.dcfg.zero else set()
