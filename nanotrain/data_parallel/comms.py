"""The data-parallel engine's collectives, each a small named function taking its group explicitly.

The asynchronous ones return the collective's work handle: on CUDA (NCCL) the collective runs on
NCCL's stream after what the current stream has queued, and ``work.wait()`` makes the current
stream wait for it without blocking the host; on CPU (gloo) it runs on gloo's thread and
``work.wait()`` blocks. Tensors that live in host memory while NCCL needs them on the device
(masters and moments, the loss) travel through ``device``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanotrain.distributed import Group

Work = dist.Work
# torch 2.13 renamed these (the old names warn); torch 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def sum_async(flat: torch.Tensor, group: Group) -> Work:
    """Start summing ``flat`` in place over ``group``."""
    return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)


def reduce_scatter_async(shard: torch.Tensor, flat: torch.Tensor, group: Group) -> Work:
    """Start summing ``flat`` over ``group`` into this rank's ``shard`` of it (``flat`` is left as it was)."""
    return _reduce_scatter(shard, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_gather_async(flat: torch.Tensor, shard: torch.Tensor, group: Group) -> Work:
    """Start filling ``flat`` with every rank's ``shard``, in rank order."""
    return _all_gather(flat, shard, group=group, async_op=True)


def broadcast_from_first(tensors: list[torch.Tensor], group: Group, device: torch.device) -> None:
    """Overwrite ``tensors`` (in place, on any device) with the group's first rank's values."""
    src = dist.get_global_rank(group, 0)
    for t in tensors:
        moved = t.to(device)
        dist.broadcast(moved, src=src, group=group)
        if moved is not t:
            t.copy_(moved)


def sum_value(value: float, group: Group, device: torch.device) -> float:
    """``value`` summed over ``group`` (in float64: the partial losses of one step)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t.item())


def gather_flat(shard: torch.Tensor, group: Group, device: torch.device) -> torch.Tensor:
    """Every rank's ``shard`` (on any device) end to end, on ``device``, on every rank."""
    n = dist.get_world_size(group)
    mine = shard.to(device)
    full = torch.empty(n * mine.numel(), dtype=mine.dtype, device=device)
    _all_gather(full, mine, group=group)
    return full


def differs_from_first(flat: torch.Tensor, group: Group) -> bool:
    """Whether ``flat`` differs by a single bit from the group's first rank's, on any rank."""
    first = flat.clone()
    dist.broadcast(first, src=dist.get_global_rank(group, 0), group=group)
    bad = torch.tensor([0 if torch.equal(first.view(torch.uint8), flat.view(torch.uint8)) else 1],
                       device=flat.device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return bool(bad.item())
