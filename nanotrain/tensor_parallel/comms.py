"""The collectives of tensor parallelism, as tiny autograd functions named ``forward_backward``.

Each pairs a forward collective with the collective its gradient needs (Megatron's mappings):

==============================  =====================  =========================================
function                        forward                backward
==============================  =====================  =========================================
``copy_all_reduce``  (f)        identity               all-reduce: each rank's input grad is partial
``all_reduce_copy``  (g)        all-reduce             identity
``all_gather_split``            all-gather along dim   keep this rank's slice
``all_gather_reduce_scatter``   all-gather tokens      reduce-scatter tokens (sequence parallel)
``reduce_scatter_all_gather``   reduce-scatter tokens  all-gather tokens (sequence parallel)
==============================  =====================  =========================================

Every one takes its process group explicitly and is the identity when the group has one rank, so
TP=1 runs the same code with no communication. Sequence-parallel ones work on dim 0, the token
dim of the flat ``[tokens, C]`` activations, where a shard is contiguous and needs no copy.

On meta tensors (a pipeline's ``boundary_shapes`` runs its stages on the meta device) every
collective returns a tensor of the right shape and sends nothing.

Every public function here is ``torch.compiler.disable``d: a compiled block breaks its graph at each
(``ops``), so its collectives run eagerly, exactly as in the eager step, between compiled regions of
local compute.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from nanotrain.distributed.collectives import Group


def group_size(group: Group) -> int:
    """Ranks in ``group``; with one, every function here is the identity."""
    return dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    # On a copy: the incoming tensor may be shared, e.g. one gradient fanned out to both branches
    # of a residual add, and must not change under anyone's feet.
    out = x.contiguous().clone()
    if not out.is_meta:
        dist.all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; torch 2.11 has only the old name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
    if not x.is_meta:
        gather(out, x, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    size = group_size(group)
    if x.shape[0] % size:
        raise ValueError(f"cannot reduce-scatter {x.shape[0]} tokens over {size} ranks; "
                         f"make batch * sequence length a multiple of {size}")
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    if not x.is_meta:
        scatter(out, x.contiguous(), group=group)
    return out


def _split(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    size = group_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"cannot split dim {dim} of shape {tuple(x.shape)} into {size} equal parts; "
                         f"make it a multiple of the group size {size}")
    return x.chunk(size, dim)[dist.get_rank(group)].contiguous()


def _identity(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x


class _Paired(torch.autograd.Function):
    """``forward(x, group)`` in forward, ``backward(grad, group)`` in backward: every pair below."""

    @staticmethod
    def forward(ctx, x, group, forward, backward):  # type: ignore[override]
        ctx.group, ctx.backward_fn = group, backward
        return forward(x, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return ctx.backward_fn(grad, ctx.group), None, None, None


def _paired(x: torch.Tensor, group: Group, forward: Callable, backward: Callable) -> torch.Tensor:
    return x if group_size(group) == 1 else _Paired.apply(x, group, forward, backward)


@torch.compiler.disable
def copy_all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a region where every rank computes a part from the same input (Megatron's f)."""
    return _paired(x, group, _identity, _all_reduce)


@torch.compiler.disable
def all_reduce_copy(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum the partial results of a row-parallel layer (Megatron's g)."""
    return _paired(x, group, _all_reduce, _identity)


@torch.compiler.disable
def all_gather_split(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Concatenate equal shards along ``dim`` for a consumer that every rank runs alike."""
    return _paired(x, group, partial(_all_gather, dim=dim), partial(_split, dim=dim))


@torch.compiler.disable
def all_gather_reduce_scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Token shards -> all tokens on every rank; gradients come back summed to their shard."""
    return _paired(x, group, _all_gather, _reduce_scatter)


@torch.compiler.disable
def reduce_scatter_all_gather(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Partial sums over all tokens -> this rank's token shard of the total."""
    return _paired(x, group, _reduce_scatter, _all_gather)
