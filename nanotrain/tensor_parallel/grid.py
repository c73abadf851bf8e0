"""The rank grid: each rank's coordinates in (pipeline, data, tensor) and its process groups.

Built once, after ``dist.init_process_group``, and passed explicitly to everything that talks.
Tensor-parallel ranks are adjacent, ``grid index = (pp_rank * dp + dp_rank) * tp + tp_rank``,
because a TP group talks in every layer and must stay inside one node's NVLink domain; pipeline
stages, which talk least, are furthest apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist


@dataclass(frozen=True)
class GridConfig:
    tp: int = 1
    dp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"GridConfig.{name}={getattr(self, name)} must be at least 1")

    @property
    def size(self) -> int:
        return self.tp * self.dp * self.pp


@dataclass(frozen=True)
class RankGrid:
    config: GridConfig
    tp_rank: int
    dp_rank: int
    pp_rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def dp(self) -> int:
        return self.config.dp

    @property
    def pp(self) -> int:
        return self.config.pp


def _index(config: GridConfig, pp: int, dp: int, tp: int) -> int:
    return (pp * config.dp + dp) * config.tp + tp


def build_grid(config: GridConfig, ranks: Sequence[int] | None = None) -> RankGrid | None:
    """The grid over ``ranks`` (default: the whole world); ``None`` on a rank outside it.

    Every rank of the world must call this with the same arguments, because creating a process
    group is collective over the world even for ranks that are not in it.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_grid needs torch.distributed: call dist.init_process_group first "
                           "(torchrun, or nanotrain.tensor_parallel.launch.spawn on CPU)")
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    if len(ranks) != config.size:
        raise ValueError(f"a grid of tp={config.tp} x dp={config.dp} x pp={config.pp} needs {config.size} ranks, "
                         f"got {len(ranks)}; change the sizes or launch {config.size} processes")
    me = dist.get_rank()
    coords = {"tp": 0, "dp": 0, "pp": 0}
    groups = {}
    t, d, p = config.tp, config.dp, config.pp
    # All groups are created in the same order on every rank, as new_group requires.
    layouts = (
        ("tp", [[_index(config, pp, dp, x) for x in range(t)] for pp in range(p) for dp in range(d)]),
        ("dp", [[_index(config, pp, x, tp) for x in range(d)] for pp in range(p) for tp in range(t)]),
        ("pp", [[_index(config, x, dp, tp) for x in range(p)] for dp in range(d) for tp in range(t)]),
    )
    for axis, index_lists in layouts:
        for indices in index_lists:
            members = [ranks[i] for i in indices]
            group = dist.new_group(members)
            if me in members:
                groups[axis] = group
                coords[axis] = members.index(me)
    if me not in ranks:
        return None
    return RankGrid(config, coords["tp"], coords["dp"], coords["pp"], groups["tp"], groups["dp"], groups["pp"])
