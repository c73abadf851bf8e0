"""The rank grid: each rank's coordinates in (tensor, pipeline, data) parallelism and its groups.

Built once, after the process group exists, and passed explicitly to everything that talks.
``order`` lists the axes from innermost (consecutive global ranks) to outermost. The default
puts tensor parallelism innermost, because a TP group talks in every layer and must stay inside
one node's NVLink domain; then data-parallel replicas, which talk once a step (overlapped
with backward); pipeline stages, which send one activation per micro-batch, furthest apart, so
that across nodes the pipeline crosses the slow links. Which global ranks share a group is a pure
function of the config (``members``), so it can be checked without any process group. The grid
carries the world's timeout, and every group made for the run (these, a pipeline's tied leaves, a
tensor-parallel key/value head) waits no longer: torch's default for a group is 30 minutes.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from itertools import product
from typing import Sequence

import torch.distributed as dist

AXES = ("tp", "dp", "pp")
TIMEOUT = timedelta(seconds=120)  # a world's and its grid's, unless init_distributed is given another


@dataclass(frozen=True)
class GridConfig:
    tp: int = 1
    dp: int = 1
    pp: int = 1
    order: tuple[str, ...] = AXES  # innermost first

    def __post_init__(self) -> None:
        for name in AXES:
            if getattr(self, name) < 1:
                raise ValueError(f"GridConfig.{name}={getattr(self, name)} must be at least 1")
        if sorted(self.order) != sorted(AXES):
            raise ValueError(f"grid order {'-'.join(self.order)!r} must name each of tp, pp, dp once "
                             f"(innermost first), e.g. tp-dp-pp")

    @property
    def size(self) -> int:
        return self.tp * self.dp * self.pp

    def index(self, coords: dict[str, int]) -> int:
        """The grid index (rank within the grid) of ``{"tp": t, "pp": p, "dp": d}``."""
        index, stride = 0, 1
        for axis in self.order:
            index += coords[axis] * stride
            stride *= getattr(self, axis)
        return index

    def coords(self, index: int) -> dict[str, int]:
        out = {}
        for axis in self.order:
            out[axis], index = index % getattr(self, axis), index // getattr(self, axis)
        return out

    def members(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` as grid indices, in a fixed order (the same on every rank)."""
        others = [a for a in AXES if a != axis]
        groups = []
        for fixed in product(*(range(getattr(self, a)) for a in others)):
            base = dict(zip(others, fixed))
            groups.append([self.index({**base, axis: x}) for x in range(getattr(self, axis))])
        return groups


def parse_order(text: str) -> tuple[str, ...]:
    """``"tp-dp-pp"`` -> ``("tp", "dp", "pp")``; the check is GridConfig's."""
    return tuple(a.strip() for a in text.replace(",", "-").split("-") if a.strip())


@dataclass(frozen=True)
class RankGrid:
    config: GridConfig
    tp_rank: int
    dp_rank: int
    pp_rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    ranks: tuple[int, ...]  # the global rank of each grid index
    timeout: timedelta = TIMEOUT  # the world's: the longest any wait in a group made for the run may take

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def dp(self) -> int:
        return self.config.dp

    @property
    def pp(self) -> int:
        return self.config.pp

    def global_rank(self, **coords: int) -> int:
        """The global rank at this rank's coordinates with some replaced, e.g. ``global_rank(pp=0)``."""
        mine = {"tp": self.tp_rank, "dp": self.dp_rank, "pp": self.pp_rank}
        return self.ranks[self.config.index({**mine, **coords})]

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` as global ranks (for building subgroups collectively)."""
        return [[self.ranks[i] for i in g] for g in self.config.members(axis)]


def build_grid(config: GridConfig, ranks: Sequence[int] | None = None,
               timeout: timedelta = TIMEOUT) -> RankGrid | None:
    """The grid over ``ranks`` (default: the whole world); ``None`` on a rank outside it.

    Every rank of the world must call this with the same arguments, because creating a process
    group is collective over the world even for ranks that are not in it. ``timeout`` bounds every
    wait in the grid's groups: pass the world's (``ctx.grid.timeout``; ``init_distributed`` does).
    """
    if not dist.is_initialized():
        raise RuntimeError("build_grid needs torch.distributed: call init_distributed first "
                           "(under torchrun, or nanotrain.distributed.spawn on CPU)")
    ranks = tuple(range(dist.get_world_size())) if ranks is None else tuple(ranks)
    if len(ranks) != config.size:
        raise ValueError(f"a grid of tp={config.tp} x pp={config.pp} x dp={config.dp} needs {config.size} ranks, "
                         f"got {len(ranks)}; change the sizes or launch {config.size} processes")
    me = dist.get_rank()
    groups = {}
    for axis in AXES:  # every rank creates every group in the same order, as new_group requires
        for indices in config.members(axis):
            members = [ranks[i] for i in indices]
            group = dist.new_group(members, timeout=timeout)
            if me in members:
                groups[axis] = group
    if me not in ranks:
        return None
    c = config.coords(ranks.index(me))
    return RankGrid(config, c["tp"], c["dp"], c["pp"], groups["tp"], groups["dp"], groups["pp"], ranks, timeout)
