"""Collectives over flattened buckets: one large message instead of one per tensor."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

Group = dist.ProcessGroup

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


def average_grads(params: Iterable[torch.Tensor], group: Group) -> None:
    """Average ``.grad`` over the data-parallel ``group``, after backward.

    Exact when every replica's loss is a mean over equally many tokens. The data-parallel engine
    overlaps this with backward; this plain form serves engines that reduce once at the end.
    """
    grads = [p.grad for p in params if p.grad is not None]
    all_reduce_coalesced(grads, group, scale=1.0 / dist.get_world_size(group))
