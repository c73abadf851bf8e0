"""This rank's share of a 3D-parallel model: a tensor-parallel pipeline per data-parallel replica.

Every rank gets the same global batch (a pure function of the step) and keeps its replica's
contiguous slice, cut into the schedule's micro-batches (``replica_slice``). A rank's leaves are
grouped into units by the moment their gradient is final (``grad_units``): the leaves of each of its
stages, final at that stage's last backward action of the step (the pipeline's ``on_stage_done``; a
leaf read by two of the rank's stages belongs to the one that finishes later), and each tied leaf (a
tied embedding, copied on the first and last stage) in a unit of its own, final once its copies are
summed after the schedule. These are the units the data-parallel engine reduces and updates
(``trainer.py``), as the trainers' are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from nanotrain.distributed import DistContext, RankGrid
from nanotrain.compose.layered import tp_layered
from nanotrain.pipeline.build import Pipeline, build_pipeline
from nanotrain.pipeline.schedule import Schedule
from nanotrain.tensor_parallel.shard import TPPlan, plan_tp
from nanotrain.core.leaves import Start
@dataclass
class Parallel3D:
    pipe: Pipeline  # this rank's stages, over its TP shard of their leaves
    plan: TPPlan


def build_3d(ctx: DistContext, cfg: Any, schedule: Schedule, seq_len: int, micro_batch: int,
             sequence_parallel: bool = False, sublayers: bool = False, recompute: bool = False,
             counts: Sequence[int] | None = None, seed: int = 0, dtype: torch.dtype = torch.float32,
             weights: Start | None = None, overlap: bool = False, compile: Any = None) -> Parallel3D:
    """This rank's share of the model (any family's config) on ``ctx.grid``: its pipeline stages,
    tensor-parallel, initialised as ``models.init_params(cfg, seed)`` would be (or from the
    whole model's ``weights``: a tree, or leaves taken one at a time), then sharded. ``overlap``:
    the TP collectives overlapped with their matmuls (``tensor_parallel.overlap``). ``compile``:
    a ``torch.compile`` backend for the blocks, compiled between their collectives
    (``tensor_parallel.ops``). Every rank of the world must call it."""
    if sequence_parallel and (micro_batch * seq_len) % ctx.grid.tp:
        raise ValueError(f"sequence parallelism splits a micro-batch's {micro_batch} x {seq_len} tokens over "
                         f"tp={ctx.grid.tp}; make micro_batch * seq_len a multiple of {ctx.grid.tp}")
    plan = plan_tp(cfg, ctx.grid, sequence_parallel, overlap=overlap, compile=compile)
    model = tp_layered(plan, seq_len, sublayers, recompute, weights)
    example = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    return Parallel3D(build_pipeline(ctx, model, schedule, example, counts, seed, dtype), plan)


def replica_slice(batch: torch.Tensor, grid: RankGrid, n_microbatches: int) -> torch.Tensor:
    """This replica's contiguous share of ``[B, ...]`` as ``[micro-batches, B / (dp * micro-batches), ...]``."""
    b, parts = batch.shape[0], grid.dp * n_microbatches
    if b % parts:
        raise ValueError(f"a global batch of {b} sequences does not split into dp={grid.dp} replicas x "
                         f"{n_microbatches} micro-batches; use a multiple of {parts}")
    share = b // grid.dp
    mine = batch[grid.dp_rank * share:(grid.dp_rank + 1) * share]
    return mine.reshape(n_microbatches, share // n_microbatches, *batch.shape[1:])


def grad_units(pipe: Pipeline) -> tuple[dict[str, list[str]], dict[int, list[str]]]:
    """This rank's units in forward order (the reverse of when they are final), and per stage the units
    that are final when its ``on_stage_done`` comes (the tied ones only once their copies are summed)."""
    acts = pipe.schedule.ranks[pipe.rank]
    done = {a.stage: i for i, a in enumerate(acts) if a.kind in "BIW"}  # position of each stage's last backward
    owner: dict[str, int] = {}
    for s, spec in pipe.stages.items():
        for path in spec.paths():
            if path not in owner or done[s] > done[owner[path]]:
                owner[path] = s
    tied = {path for path, _ in pipe.tied}
    order = [path for path, _ in pipe.named_parameters()]
    units = {f"tied.{p}": [p] for p in order if p in tied}  # final last: first in forward order
    starts: dict[int, list[str]] = {}
    for s in sorted(pipe.stages, key=lambda s: -done[s]):
        paths = [p for p in order if owner[p] == s and p not in tied]
        if paths:
            units[f"stage{s}"] = paths
            starts[s] = [f"stage{s}"]
    return units, starts
