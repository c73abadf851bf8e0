"""Gradient reductions after backward, outside the autograd graph.

Sequence parallelism: a replicated parameter (LayerNorm, row-parallel bias, ``wpe``) is applied
to this rank's tokens only, so its gradient is a partial sum over tokens and must be summed over
the TP group. Without sequence parallelism every rank applies it to all tokens and its gradient
is already whole and identical on every rank: summing would multiply it by tp. Averaging over
data-parallel replicas is not tensor parallelism's business: ``nanotrain.distributed.average_grads``.
"""
from __future__ import annotations

from nanotrain.distributed.collectives import all_reduce_coalesced
from nanotrain.tensor_parallel.shard import TPPlan, replicated_leaves
from nanotrain.tree import Tree


def sync_grads(local: Tree, plan: TPPlan) -> None:
    """Finish this rank's ``.grad`` of a GPT-2 shard: sum the partial sums over TP (sequence parallel)."""
    if plan.sequence_parallel:
        all_reduce_coalesced([p.grad for p in replicated_leaves(local) if p.grad is not None], plan.grid.tp_group)
