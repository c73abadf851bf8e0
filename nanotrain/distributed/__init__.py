"""What every parallel engine shares: one rank grid, one way to join, one spawner, one failure watch."""
from nanotrain.distributed.collectives import BUCKET_ELEMENTS, Group, all_reduce_coalesced, average_grads
from nanotrain.distributed.context import (DistContext, close_distributed, init_distributed, launched_world_size,
                                           run_in_group)
from nanotrain.distributed.failure import FailureWatch, RankFailure, failures_reported
from nanotrain.distributed.grid import GridConfig, RankGrid, build_grid, parse_order
from nanotrain.distributed.spawn import SpawnError, free_port, spawn

__all__ = ["BUCKET_ELEMENTS", "DistContext", "FailureWatch", "GridConfig", "Group", "RankFailure", "RankGrid",
           "SpawnError", "all_reduce_coalesced", "average_grads", "build_grid", "close_distributed",
           "failures_reported", "free_port", "init_distributed", "launched_world_size", "parse_order", "run_in_group",
           "spawn"]
