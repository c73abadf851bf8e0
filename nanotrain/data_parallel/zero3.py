"""ZeRO-3: the resident trainer whose weights (``GatheredWeights``) are sharded too, each unit gathered
just before use and its memory released after it.

Every rank keeps, per unit of the model's spec (the embeddings, each block, the head), only its shard
of the unit's flat padded vector (``buckets.py``): fp32 masters and moments in its ``ShardedAdam``
(``shards.py``) and the compute-dtype shard on the device. ``ResidentTrainer`` runs ``models.run.run_units``
as ever, each unit wrapped (the ``run`` hook) in a segment, an ``autograd.Function`` over the units it
reads: a unit's own, and for the head also the unit holding the output matrix when that is not its own
(a head tied to the token embedding reads the embedding unit again):

- forward: all-gather the segment's units into each unit's one flat tensor (the next segment's gathering
  is started first, so it runs during this one's compute), run the segment with autograd under the
  trainer's recompute policy (compiled blocks too), then release the flat tensors' memory
  (``storage.resize_(0)``): the graph keeps its activations, and views of weights that are now empty;
- backward: gather the segment again into the same flat tensors (the previous segment's gathering started
  ahead), so the views the graph saved hold the weights again, run the segment's backward, release them;
  each unit's gradient (in fp32, summed over its uses: a tied embedding's two) is reduce-scattered as soon
  as its last use in the micro-batch is done, and each rank adds its shard into an fp32 accumulator of 1/N
  of the unit. On the last micro-batch the accumulated shard goes to the optimizer at once, so the update
  overlaps the rest of backward;
- evaluation (``evaluate``, under no_grad): the forward alone, each segment gathered as above and released.

The device therefore holds the shards, about two units' gathered weights, and the activations the
recompute policy keeps (``every``: the segments' inputs alone, each block recomputed in backward; ``none``:
all of them, nothing computed twice; compiled blocks). Releasing memory under the graph's saved views is
what FSDP does too; the gathering writes through a second tensor of the same memory, so that the saved
views' version counter, which would call the weights modified, does not see it: it writes back the
values the graph saved. Held (``hold``), no unit is released: each is gathered in place once a step (this rank's
shard is its slice) and kept to the step's end, the whole model's weights for one all-gather a step.

What then becomes of each summed shard is the core's one hand-over (``core.train.handover.UnitHandOver``), as
for the resident and 3D trainers: its units are the model's (a bucket each), a unit's one leaf (named as the
unit) this rank's shard of its fp32 sum, padding included, which goes to ``ShardedAdam.update`` whole. Without
clipping a unit is handed over as soon as its last micro-batch's shard is in (``HandOver.AT_ONCE``), so the update
overlaps the rest of backward; with clipping every unit is held, the norm taken over the shards' pieces of
parameters (``counted``: not their padding), the squares summed over the group, all clipped, then handed over
(``HELD``). fp16 scales the loss as the resident trainer does, and the hand-over unscales each unit's sum; a unit's
inf/NaN on one rank is spread to a parameter element of every rank's shard before the reduction, so all skip alike.

The hand-over's first half stays here, because ZeRO-3's is not the carrier's: a unit's weights are not taken from
the optimizer as leaves (``UnitHandOver.take``) but gathered from every rank's shard into its segment's memory, and
its gradient is not summed leaf by leaf into a buffer of the whole unit but per micro-batch in full, then
reduce-scattered, and only this rank's shard summed over the micro-batches (``Pass.accumulate``): a bucket is final
when its last micro-batch's reduction is waited for.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from nanotrain.data_parallel import comms
from nanotrain.data_parallel.buckets import Bucket, cut, plan_buckets, sentinels, spread_nonfinite
from nanotrain.data_parallel.shards import ShardedAdam
from nanotrain.core.train.shard import moment_block
from nanotrain.distributed import Group
from nanotrain.core.leaves import Start, as_leaves
from nanotrain.core.models.run import empty_tree
from nanotrain.core.models.spec import ModelSpec, Unit
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.optim.offload import resolve_device
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.core.train.handover import HandOver, UnitHandOver
from nanotrain.core.train.resident import TrainConfig, check_fp16_at_once
from nanotrain.core.train.step import Pass, unit_reads
from nanotrain.core.tree import Tree, named_leaves, set_path


_LEAD = 2  # reductions the host may launch before the first of them has finished (``_keep_pace``)


class _Segment(torch.autograd.Function):
    """``run(tree, x)`` over the gathered weights of segment ``k``: its graph built in forward and kept, run
    backward once the weights are gathered again under it."""

    @staticmethod
    def forward(ctx, engine: "GatheredWeights", k: int, run: Callable, x: torch.Tensor, anchor: torch.Tensor):
        tree = engine.gather(k, ahead=1)
        leaves = {p: t.detach().requires_grad_() for p, t in named_leaves(tree) if t is not None}
        for p, t in leaves.items():
            set_path(tree, p, t)
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            out = run(tree, x)
        engine.release(k)
        ctx.engine, ctx.k, ctx.kept = engine, k, (out, x, leaves)
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        engine, k = ctx.engine, ctx.k
        (out, x, leaves), ctx.kept = ctx.kept, None  # nothing of it outlives this segment's backward
        engine.gather(k, ahead=-1)  # back into the tensors the graph's saved views are of
        torch.autograd.backward(out, grad_out)
        engine.release(k)
        engine.add_grads(k, {p: t.grad for p, t in leaves.items()})
        return None, None, None, x.grad, None


class GatheredWeights:
    """The resident trainer's ``Weights`` under ZeRO-3: weights, gradients and optimizer state sharded over ``group``.

    ``data_parallel_trainer`` builds it (``tcfg.batch`` is this rank's part of the batch) from the model's leaves
    (``core.leaves``, or a tree they are taken from), each cut to this rank's shard as it is read."""

    def __init__(self, spec: ModelSpec, params: Start, tcfg: TrainConfig, adam: AdamConfig, ocfg: OffloadConfig,
                 at: Pass, group: Group, hold: bool = False):
        check_fp16_at_once(ocfg, tcfg)
        self.block_fn = RecomputePolicy.parse(tcfg.recompute).block_fn(spec, compile=tcfg.compile)
        self.spec, self.at, self.group = spec, at, group
        self.device, self.dtype = resolve_device(ocfg), ocfg.dtype
        self.units = units = spec.unit_dict()
        leaves = as_leaves(params)
        self.buckets = plan_buckets(units, {p: torch.Size(s) for p, s in leaves.shapes.items()}, 0,
                                    dist.get_world_size(group), moment_block(ocfg) or 1)
        self.bucket = {b.units[0]: b for b in self.buckets}
        self.hold = hold
        self._full = {b.units[0]: torch.empty(b.padded, dtype=self.dtype, device=self.device)  # by unit: its one
                      for b in self.buckets}                                                 # flat, gathered weights
        rank = dist.get_rank(group)
        # held: this rank's shard is its slice of the gathered unit (the all-gather runs in place), so the weights are
        # held once; else the optimizer keeps the shard apart and each unit's memory is held only from its gathering
        # to its release
        send = {b.name: self._full[b.units[0]][rank * b.shard:(rank + 1) * b.shard] for b in self.buckets} \
            if hold else None
        for full in () if hold else self._full.values():
            full.untyped_storage().resize_(0)
        self._fresh: set[str] = set()  # the units gathered since their weights last changed
        # each leaf read and cut to this rank's shard as it comes: neither the host nor the device holds the model
        self.opt = ShardedAdam(leaves, units, self.buckets, adam, ocfg, group, sharded=True, send=send)
        self._cuda = self.device.type == "cuda"
        self._side = torch.cuda.Stream(self.device) if self._cuda else None
        self._eager = self._cuda and ocfg.offload  # as in DataParallelAdam: never block backward on a reduction
        self.segments = list(unit_reads(spec).values())  # segment k: the units unit k reads
        self._segment_of = {unit.name: k for k, unit in enumerate(spec.units)}
        self._uses = {u: sum(u in s for s in self.segments) for u in units}
        acc = {u: torch.zeros(b.shard, device=self.device) for u, b in self.bucket.items()}  # this rank's shard sums
        fp16_inexact = ocfg.dtype == torch.float16 and not ocfg.exact_skip  # refused above unless clipping
        # the hand-over's carrier is the inner AdamW, which leaves clipping to it; a unit reaches it through ``update``
        self.hand = UnitHandOver(self.opt.inner, {u: [u] for u in self.bucket}, at,
                                 HandOver.choose(self.opt.inner, tcfg.clip_norm, fp16_inexact, redoes=False),
                                 tcfg.clip_norm, accum=acc, group=group,
                                 counted=[p for b, pieces in self.opt.layout for p in cut(acc[b.units[0]], pieces)],
                                 update=lambda name, sums: self.opt.update(self.bucket[name], *sums))
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)
        self._gathering: dict[str, comms.Work] = {}
        self._partial: dict[str, torch.Tensor] = {}         # this micro-batch's gradient, by unit
        self._left: dict[str, int] = {}
        self._pending: list[tuple[Bucket, comms.Work, torch.Tensor, torch.Tensor]] = []
        self._sentinels = {b.name: sentinels(b, self.device) for b in self.buckets}

    # -- weights: gather before use, free after ------------------------------------------------

    def held(self) -> list[str]:
        """The units whose gathered weights take memory now."""
        return [u for u, full in self._full.items() if full.untyped_storage().nbytes()]

    def _launch_gather(self, unit: str) -> None:
        full = self._full[unit]
        if unit in self._fresh:
            return
        self._fresh.add(unit)
        if not self.hold:
            full.untyped_storage().resize_(full.numel() * full.element_size())
        # written through a second tensor of the same memory, whose version counter the collective's write bumps
        # (on some backends when it completes): the graph's saved views of ``full`` hold the same values again; made
        # here, while the memory is held (one made once, while it held none, gathered into the wrong place on CPU)
        into = torch.empty(0, dtype=full.dtype, device=full.device).set_(full.untyped_storage(), 0, full.shape)
        self._gathering[unit] = comms.all_gather_async(into, self.opt.new_shard(self.bucket[unit]), self.group)

    def gather(self, k: int, ahead: int) -> Tree:
        """Segment ``k``'s weights as a tree, after starting the gathering of segment ``k + ahead``."""
        for unit in self.segments[k]:
            self._launch_gather(unit)
        if 0 <= k + ahead < len(self.segments):
            for unit in self.segments[k + ahead]:
                self._launch_gather(unit)
        tree = empty_tree(self.spec)
        for unit in self.segments[k]:
            if unit in self._gathering:
                self._gathering.pop(unit).wait()
            for path, view in self.bucket[unit].views(self._full[unit]).items():
                set_path(tree, path, view)
        return tree

    def release(self, k: int) -> None:
        """Segment ``k``'s memory freed (held weights stay to the step's end: its update makes them stale)."""
        for unit in () if self.hold else self.segments[k]:
            self._full[unit].untyped_storage().resize_(0)
            self._fresh.discard(unit)

    def run_segment(self, k: int, fn: Callable, x: torch.Tensor | None) -> torch.Tensor:
        """``fn(tree, x)`` over segment ``k``'s gathered weights (the next segment's gathering started first), which
        are freed after it."""
        out = fn(self.gather(k, ahead=1), x)
        self.release(k)
        return out

    # -- gradients: reduce-scatter each unit after its last use in the micro-batch --------------

    def add_grads(self, k: int, grads: dict[str, torch.Tensor]) -> None:
        for unit in self.segments[k]:
            b = self.bucket[unit]
            first = unit not in self._partial  # written, not summed into: no pass to zero it first
            if first:
                self._partial[unit] = flat = torch.empty(b.padded, device=self.device)
                for lo, hi in b.gaps():
                    flat[lo:hi].zero_()
            views = b.views(self._partial[unit])
            for path in self.units[unit]:
                g = grads.get(path)
                if g is None:
                    if first:
                        views[path].zero_()
                elif first:
                    views[path].copy_(g)
                else:
                    views[path].add_(g)
            self._left[unit] -= 1
            if self._left[unit] == 0:
                flat = self._partial.pop(unit)
                spread_nonfinite(flat, self._sentinels[b.name])
                shard = torch.empty(b.shard, device=self.device)
                self._pending.append((b, comms.reduce_scatter_async(shard, flat, self.group), shard, flat))
                self._keep_pace()
        self._hand_over(wait=False)

    def _keep_pace(self) -> None:
        """Hold the host until at most ``_LEAD`` reductions are unfinished. Each unit's fp32 sum stays allocated until
        its reduce-scatter has run, and the caching allocator counts it from the moment the host asks: a host that runs
        far ahead (compiled blocks launch few kernels, so it fills the launch queue units in advance) would hold one
        sum for every unit it is ahead, about a GiB each at 8B; so would collectives that fall behind the compute. (A
        host paced on the compute stream alone let held 8B ranks reach 78.5 GiB, 7 over what is counted.)"""
        while self._cuda and len(self._pending) > _LEAD:
            self._hand_over(wait=False)
            if len(self._pending) > _LEAD:
                time.sleep(1e-4)

    def _hand_over(self, wait: bool) -> None:
        """Add each finished reduction into its bucket's shard sum, on the side stream (none on the CPU); after the
        last micro-batch's the bucket is final (``UnitHandOver.final``: unscaled, handed over or held)."""
        while self._pending and (wait or self._eager or self._pending[0][1].is_completed()):
            b, work, shard, flat = self._pending.pop(0)
            with torch.cuda.stream(self._side):
                work.wait()
                if self.at.accumulate(self.hand.accum[b.units[0]], shard):
                    self.hand.final(b.units[0])
                if self._cuda:
                    shard.record_stream(self._side)
                    flat.record_stream(self._side)

    # -- the trainer's side (``train.step.Weights``) ----------------------------------------------

    def begin(self) -> None:
        if self.at.micro == 0:
            if self._cuda:
                self.at.clock.mark("optimizer")
            self._stale()
        self._left = dict(self._uses)

    def run(self, unit: Unit, fn: Callable, x: torch.Tensor | None) -> torch.Tensor:
        """``run_units``' hook: ``unit`` as its segment (the embeddings take the anchor for an input, so that
        autograd reaches their backward). No parameter tree: each unit's weights are its segment's, gathered."""
        return _Segment.apply(self, self._segment_of[unit.name], fn, self._anchor if x is None else x, self._anchor)

    def end(self) -> None:
        self._hand_over(wait=True)

    def finish(self) -> torch.Tensor | None:
        """Clipping: the held buckets clipped by the norm over the group (returned) and handed over."""
        if self.hand.hand_over is HandOver.HELD and self._cuda:  # their sums were made on the side stream
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        return self.hand.finish()

    def evaluate(self, unit: Unit, fn: Callable, x: torch.Tensor | None) -> torch.Tensor:
        """``unit`` as its segment's forward, without autograd; the embeddings, first of every forward, wait for the
        last step's updates (on the side stream) as ``begin`` does."""
        k = self._segment_of[unit.name]
        if k == 0:
            self._stale()
        return self.run_segment(k, fn, x)

    def _stale(self) -> None:
        """Before a step's or an evaluation's first unit: the last step's updates (inline without offload, on the side
        stream) waited for, and every held unit to be gathered again (they, or a restored state, changed the shards)."""
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        self._fresh.clear()
