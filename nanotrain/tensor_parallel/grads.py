"""Gradient reductions after backward, outside the autograd graph: the whole leaves whose gradient each rank holds
a part of, summed over the TP group (which, and why: ``shard.summed``), and with more ranks than key/value
heads, a head's rows summed over the ranks sharing it: each holds their gradient from its own query heads only.
Averaging over data-parallel replicas is not tensor parallelism's business:
``nanotrain.distributed.average_grads``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanotrain.distributed.collectives import all_reduce_coalesced
from nanotrain.tensor_parallel.shard import TPPlan, counted_pieces, kv_pieces, replicated_leaves, summed
from nanotrain.core.tree import Tree, named_leaves


def sum_partial_grads(grads: dict[str, torch.Tensor], plan: TPPlan) -> None:
    """Sum in place what each rank holds a part of in ``grads`` (leaf path -> this rank's gradient): the whole
    leaves' gradients over TP, a shared key/value head's rows over the ranks sharing it."""
    all_reduce_coalesced([g for path, g in grads.items() if summed(path, plan)], plan.grid.tp_group)
    if plan.kv_group is not None:
        all_reduce_coalesced([piece for path, g in grads.items() for piece in kv_pieces(path, g, plan)], plan.kv_group)


def sync_grads(local: Tree, plan: TPPlan) -> None:
    """Finish this rank's ``.grad`` of its shard (``sum_partial_grads``)."""
    sum_partial_grads({path: p.grad for path, p in named_leaves(local)
                       if isinstance(p, torch.Tensor) and p.grad is not None}, plan)


def _squares(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).square().sum()


def grad_norm(local: Tree, plan: TPPlan) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, on every rank (after ``sync_grads``): the shards' squares
    summed over the TP group, each replicated parameter counted once (its gradient is the same everywhere), and
    so each shared key/value head's rows (``shard.counted_pieces``). For clipping (``nanotrain.core.train.clip``): the
    vocabulary's zero padding rows add nothing."""
    replicated = replicated_leaves(local, plan.spec)
    ids = {id(p) for p in replicated}
    pieces = [piece for path, p in named_leaves(local) if isinstance(p, torch.Tensor) and p.grad is not None
              and id(p) not in ids for piece in counted_pieces(path, p.grad, plan)]
    sharded = _squares(pieces)
    dist.all_reduce(sharded, group=plan.grid.tp_group)
    return (sharded + _squares([p.grad for p in replicated if p.grad is not None])).sqrt()
