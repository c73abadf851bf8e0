"""Gradient reductions after backward, outside the autograd graph.

Sequence parallelism: a replicated parameter (a norm, a row-parallel bias, a position table) is applied
to this rank's tokens only, so its gradient is a partial sum over tokens and must be summed over
the TP group. Without sequence parallelism every rank applies it to all tokens and its gradient is already
whole and identical on every rank. A whole leaf applied inside a parallel region (a per-head norm) sees this
rank's heads alone: partial either way (``shard.summed_leaves``). Averaging over data-parallel replicas is
not tensor parallelism's business: ``nanotrain.distributed.average_grads``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanotrain.distributed.collectives import all_reduce_coalesced
from nanotrain.tensor_parallel.shard import TPPlan, replicated_leaves, summed_leaves
from nanotrain.tree import Tree, named_leaves


def sync_grads(local: Tree, plan: TPPlan) -> None:
    """Finish this rank's ``.grad`` of its shard: sum the partial sums over TP."""
    all_reduce_coalesced([p.grad for p in summed_leaves(local, plan) if p.grad is not None], plan.grid.tp_group)


def _squares(leaves: list[torch.Tensor]) -> torch.Tensor:
    grads = [p.grad for p in leaves if p.grad is not None]
    return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).square().sum()


def grad_norm(local: Tree, plan: TPPlan) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, on every rank (after ``sync_grads``): the shards' squares
    summed over the TP group, each replicated parameter counted once (its gradient is the same everywhere).
    For clipping (``nanotrain.train.clip``): the vocabulary's zero padding rows add nothing."""
    replicated = replicated_leaves(local, plan.spec)
    ids = {id(p) for p in replicated}
    sharded = _squares([p for _, p in named_leaves(local) if id(p) not in ids])
    dist.all_reduce(sharded, group=plan.grid.tp_group)
    return (sharded + _squares(replicated)).sqrt()
