"""Buckets: units grouped, in the order their gradients become final, into flat padded vectors.

A bucket is the unit of communication. Its parameters are laid end to end in one flat vector
(units in the order backward finishes them, each unit's parameters in its own order), padded
with zeros to a multiple of the data-parallel world size, so that rank ``r`` of ``n`` owns the
contiguous shard ``[r * padded / n, (r + 1) * padded / n)`` whatever ``n`` is (3 included). The
padding holds zero weights and receives zero gradients, so AdamW leaves it at zero.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from nanotrain.core.optim.buffers import all_finite
from nanotrain.core.train.shard import Piece


@dataclass(frozen=True)
class Bucket:
    name: str
    units: tuple[str, ...]          # in the order their gradients become final
    paths: tuple[str, ...]          # every parameter of those units, in flat order
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]        # where each parameter starts in the flat vector
    numel: int                      # where the last parameter ends (the padding after it excluded)
    padded: int                     # a multiple of ``world``
    world: int

    @property
    def shard(self) -> int:
        return self.padded // self.world

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard, (rank + 1) * self.shard

    def shape(self, path: str) -> torch.Size:
        return self.shapes[self.paths.index(path)]

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter's tensor as a view into ``flat`` (no copy)."""
        return {p: flat[o:o + s.numel()].view(s) for p, s, o in zip(self.paths, self.shapes, self.offsets)}

    def gaps(self) -> list[tuple[int, int]]:
        """The ranges of the flat vector no parameter covers: alignment between parameters, the padding after them."""
        ends = [o + s.numel() for o, s in zip(self.offsets, self.shapes)]
        bounds = zip(ends, [*self.offsets[1:], self.padded])
        return [(lo, hi) for lo, hi in bounds if hi > lo]

    def flatten(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> torch.Tensor:
        """``tensors`` (by path) laid out as this bucket's padded flat vector (a new tensor)."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for path, view in self.views(flat).items():
            view.copy_(tensors[path])
        return flat


def plan_buckets(units: dict[str, list[str]], shapes: dict[str, torch.Size], bucket_elements: int,
                 world: int, align: int = 1) -> list[Bucket]:
    """``units`` (in forward order) grouped into buckets of at least ``bucket_elements`` each (the
    last may be smaller), in reverse order: the first bucket is the first whose gradients are final.
    ``bucket_elements=0`` puts each unit in a bucket of its own. With ``align`` > 1 every parameter
    starts at a multiple of ``align`` and so does every shard (8-bit moments: see ``streamed.py``)."""
    groups: list[list[str]] = [[]]
    size = 0
    for unit in reversed(list(units)):
        if groups[-1] and size >= bucket_elements:
            groups.append([])
            size = 0
        groups[-1].append(unit)
        size += sum(shapes[p].numel() for p in units[unit])
    buckets = []
    for i, group in enumerate(groups):
        paths = tuple(p for unit in group for p in units[unit])
        sizes = [-(-shapes[p].numel() // align) * align for p in paths]
        offsets = tuple(accumulate(sizes, initial=0))[:-1]
        numel = offsets[-1] + shapes[paths[-1]].numel()
        step = world * align
        buckets.append(Bucket(f"b{i}", tuple(group), paths, tuple(shapes[p] for p in paths), offsets, numel,
                              -(-numel // step) * step, world))
    return buckets


def rank_pieces(b: Bucket, rank: int) -> list[Piece]:
    """The parameters' parts in ``rank``'s shard of ``b``, each named for an optimizer of the shard alone."""
    lo, hi = b.shard_range(rank)
    out = []
    for path, shape, offset in zip(b.paths, b.shapes, b.offsets):
        a, z = max(offset, lo), min(offset + shape.numel(), hi)
        if a < z:
            out.append(Piece(f"{b.name}_{len(out)}", path, a - offset, a - lo, z - lo))
    return out


def cut(shard: torch.Tensor, pieces: list[Piece]) -> list[torch.Tensor]:
    """``shard`` (a rank's part of a bucket, flat) cut into its ``pieces``, without the padding: a norm taken per
    parameter, as torch's ``clip_grad_norm_`` takes it, rounds less than one over the flat shard ([] would stack
    nothing: an empty piece stands for none)."""
    return [shard[p.lo:p.hi] for p in pieces] or [shard[:0]]


def sentinels(b: Bucket, device: torch.device) -> torch.Tensor:
    """An element of a parameter in each rank's shard of ``b`` that holds one (``spread_nonfinite``'s targets)."""
    return torch.tensor([r * b.shard + pieces[0].lo for r in range(b.world) if (pieces := rank_pieces(b, r))],
                        device=device)


def spread_nonfinite(flat: torch.Tensor, at: torch.Tensor) -> None:
    """An inf/NaN anywhere in ``flat`` (this rank's gradient of a bucket) made NaN at ``at`` (``sentinels``): after
    the reduction every rank's shard holds one, so every rank's optimizer sees the bucket non-finite and all skip
    the step alike."""
    poison = torch.where(all_finite([flat]), 0.0, float("nan"))
    flat.index_add_(0, at, poison.expand(len(at)))
