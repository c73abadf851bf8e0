"""The gradient reductions of a 3D step, the data-parallel one overlapped with the pipeline's cool-down.

A rank's leaves are grouped into units by the moment their gradient is final: the leaves of each
of its stages, taken at that stage's last backward action of the step (the pipeline's
``on_stage_done``; a leaf read by two of the rank's stages belongs to the one that finishes
later), and each tied leaf (a tied embedding, copied on the first and last stage) in a unit of its
own. Every unit is one bucket of ``data_parallel.buckets``: a flat vector padded to a multiple of
dp, of which each leaf's ``.grad`` is a view, so backward accumulates straight into it.

When a stage is done, for each of its units: the partial sums of whole leaves (sequence-parallel
norms, per-head norms: ``tensor_parallel.shard.summed_leaves``) are summed over TP (small, and every
rank of the TP group gets there at the same point of the same schedule), then the bucket's sum over
DP is started asynchronously (``data_parallel.comms``): an all-reduce (DDP), or a reduce-scatter into
this rank's shard when the optimizer is sharded (ZeRO-1, ``shard_gradients``). The pipeline goes on with the other
stages' backwards while it runs; ``finish`` waits for all of them just before the update.

The tied copies are summed over their pipeline group after the DP sum (all three reductions are
sums, so their order does not change the result): the tied unit's DP sum can start as soon as
its own stage is done, where summing the copies first would wait for the first stage, which
finishes last. Its bucket holds that one leaf, of the same shape on both copies, and both copies'
ranks have the same dp rank, so under ZeRO-1 each sums just its shard with its partner's.

Gradients are summed over DP, not averaged: each replica's loss is divided by the whole global
batch's count of targets (``step.grads_3d``), so the sum is exactly the global batch's gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanotrain.data_parallel import comms
from nanotrain.data_parallel.buckets import Bucket, plan_buckets
from nanotrain.distributed import all_reduce_coalesced
from nanotrain.pipeline.build import Pipeline
from nanotrain.tensor_parallel.grads import sum_kv_replicas
from nanotrain.tensor_parallel.shard import TPPlan, summed_leaves


def grad_units(pipe: Pipeline) -> tuple[dict[str, list[str]], dict[int, list[str]]]:
    """This rank's units in forward order (the reverse of when they finish), and per stage the units
    its ``on_stage_done`` starts."""
    acts = pipe.schedule.ranks[pipe.rank]
    done = {a.stage: i for i, a in enumerate(acts) if a.kind in "BIW"}  # position of each stage's last backward
    owner: dict[str, int] = {}
    for s, spec in pipe.stages.items():
        for path in spec.paths():
            if path not in owner or done[s] > done[owner[path]]:
                owner[path] = s
    tied = {path for path, _ in pipe.tied}
    order = [path for path, _ in pipe.named_parameters()]
    units: dict[str, list[str]] = {}
    starts: dict[int, list[str]] = {}
    for s in sorted(pipe.stages, key=lambda s: -done[s]):
        for name, paths in ((f"stage{s}", [p for p in order if owner[p] == s and p not in tied]),
                            *((f"tied.{p}", [p]) for p in order if owner[p] == s and p in tied)):
            if paths:
                units[name] = paths
                starts.setdefault(s, []).append(name)
    return units, starts


class GradSync:
    """The TP, DP and tied reductions of one rank's gradients (see the module docstring)."""

    def __init__(self, pipe: Pipeline, plan: TPPlan):
        self.pipe, self.plan = pipe, plan
        grid = pipe.ctx.grid
        self.group, self.world, self.rank = grid.dp_group, grid.dp, grid.dp_rank
        leaves = dict(pipe.named_parameters())
        self.units, self.starts = grad_units(pipe)
        self.buckets = plan_buckets(self.units, {p: t.shape for p, t in leaves.items()}, 0, self.world)
        self.bucket_of = {b.units[0]: b for b in self.buckets}
        some = next(iter(leaves.values()))
        self.grads = {b.name: torch.zeros(b.padded, dtype=some.dtype, device=some.device) for b in self.buckets}
        ids = {id(t) for t in summed_leaves(pipe.params, plan)}
        self.replicated = {b.name: [p for p in b.paths if id(leaves[p]) in ids] for b in self.buckets}
        self.shards: dict[str, torch.Tensor] = {}
        self._pending: list[comms.Work] = []

    @property
    def sharded(self) -> bool:
        return bool(self.shards)

    def shard_gradients(self) -> None:
        """Reduce-scatter from now on: each rank gets only its shard of the DP sum (ZeRO-1's optimizer)."""
        if self.world > 1:
            self.shards = {b.name: torch.empty_like(self.grads[b.name][:b.shard]) for b in self.buckets}

    def grad_shard(self, b: Bucket) -> torch.Tensor:
        """This rank's shard of bucket ``b``'s reduced gradient (all of it when nothing is sharded)."""
        if not self.sharded:
            return self.grads[b.name]
        return self.shards[b.name]

    def begin(self) -> None:
        """Before the pipeline: zero the buckets and make each leaf's ``.grad`` a view of its bucket."""
        leaves = dict(self.pipe.named_parameters())
        for b in self.buckets:
            for path, view in b.views(self.grads[b.name].zero_()).items():
                leaves[path].grad = view

    def stage_done(self, stage: int) -> None:
        """The pipeline's ``on_stage_done``: the stage's units are final; sum them over TP, start the DP sum."""
        for unit in self.starts.get(stage, ()):
            b = self.bucket_of[unit]
            views = b.views(self.grads[b.name])
            all_reduce_coalesced([views[p] for p in self.replicated[b.name]], self.plan.grid.tp_group)
            sum_kv_replicas(views, self.plan)  # a key/value head shared by several TP ranks (tp > its heads)
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        if self.world == 1:
            return
        flat = self.grads[b.name]
        if self.sharded:
            # A rank checks only its own shard for inf/NaN: a bucket bad anywhere is made bad everywhere.
            flat.masked_fill_(~torch.isfinite(flat).all(), float("nan"))
            self._pending.append(comms.reduce_scatter_async(self.shards[b.name], flat, self.group))
        else:
            self._pending.append(comms.sum_async(flat, self.group))

    def finish(self) -> None:
        """After the pipeline: wait for the DP sums, then sum the tied copies (whole, or this rank's shard)."""
        for work in self._pending:
            work.wait()
        self._pending.clear()
        for path, group in self.pipe.tied:
            dist.all_reduce(self.grad_shard(self.bucket_of[f"tied.{path}"]), group=group)
