"""Gradient reductions after backward, outside the autograd graph.

* Sequence parallelism: a replicated parameter (LayerNorm, row-parallel bias, ``wpe``) is applied
  to this rank's tokens only, so its gradient is a partial sum over tokens and must be summed over
  the TP group. Without sequence parallelism every rank applies it to all tokens and its gradient
  is already whole and identical on every rank: summing would multiply it by tp.
* Data parallelism: each replica saw its share of the batch; gradients are averaged over the DP
  group, exact when every replica's loss is a mean over equally many tokens.

Both are one all-reduce per bucket of flattened gradients, not one per tensor.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from nanotrain.tensor_parallel.comms import Group
from nanotrain.tensor_parallel.shard import TPPlan, replicated_leaves
from nanotrain.tree import Tree, named_leaves

BUCKET_ELEMENTS = 64 * 2**20


def all_reduce_coalesced(tensors: Iterable[torch.Tensor], group: Group, scale: float = 1.0) -> None:
    """Sum each tensor in place over ``group`` (then multiply by ``scale``), in few large collectives."""
    if dist.get_world_size(group) == 1:
        return
    bucket: list[torch.Tensor] = []

    def flush() -> None:
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(part.view_as(t))
        bucket.clear()

    size = 0
    for t in tensors:
        same_kind = bucket and t.dtype == bucket[0].dtype and t.device == bucket[0].device
        if bucket and (size + t.numel() > BUCKET_ELEMENTS or not same_kind):
            flush()
            size = 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        flush()


def _grads(leaves: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in leaves if p.grad is not None]


def sync_grads(local: Tree, plan: TPPlan) -> None:
    """Finish this rank's ``.grad`` of a GPT-2 shard: partial sums over TP (sequence parallel), mean over DP."""
    if plan.sequence_parallel:
        all_reduce_coalesced(_grads(replicated_leaves(local)), plan.grid.tp_group)
    all_reduce_coalesced(_grads(p for _, p in named_leaves(local)), plan.grid.dp_group, scale=1.0 / plan.grid.dp)
