"""Join the process group once and get everything a distributed run needs, passed explicitly.

Single node: ``torchrun --nproc-per-node 4 -m tasks.<name> ...``. Several nodes: run on every
node ``torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500
--rdzv-id JOB -m tasks.<name> ...`` with HOST reachable from all nodes; ranks are numbered node
by node, so the grid's inner axes (tensor parallel first) stay inside a node.
"""
from __future__ import annotations

import itertools
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from nanotrain.distributed.failure import FailureWatch, failures_reported
from nanotrain.distributed.grid import TIMEOUT, GridConfig, RankGrid, build_grid

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_JOINS = itertools.count()  # this process's joins, in order (every rank joins alike)


@dataclass
class DistContext:
    rank: int
    world_size: int
    device: torch.device
    store: dist.Store
    watch: FailureWatch
    grid: RankGrid
    where: str = "setup"  # what this rank is doing, for error messages

    def guard(self) -> AbstractContextManager[None]:
        """``with ctx.guard():`` any exception stops every rank with this rank's name and ``where``."""
        return failures_reported(self.watch, lambda: self.where)


def _check_launched() -> None:
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(f"environment variables {', '.join(missing)} are not set: launch with torchrun "
                           f"(torchrun --nproc-per-node N -m ...) or nanotrain.distributed.spawn")


def launched_world_size() -> int:
    """The number of processes torchrun (or the spawner) started, before joining the group."""
    _check_launched()
    return int(os.environ["WORLD_SIZE"])


def init_distributed(grid: GridConfig | None = None, backend: str | None = None,
                     timeout_s: float = TIMEOUT.total_seconds(), dead_after_s: float = 60.0) -> DistContext:
    """Join the group described by torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK).

    ``grid`` defaults to all ranks in one data-parallel group. ``backend`` defaults to NCCL when
    CUDA is available, else gloo. ``timeout_s`` bounds every collective and point-to-point wait, in
    the world and in every group made for the run (the grid carries it: ``ctx.grid.timeout``), and
    the failure watch stops every rank within about a second of any rank's failure, or
    ``dead_after_s`` after a rank was killed (it then reports nothing: its heartbeat stops).
    """
    _check_launched()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    grid = grid or GridConfig(dp=world)
    if grid.size != world:
        raise ValueError(f"tp={grid.tp} x pp={grid.pp} x dp={grid.dp} = {grid.size} ranks, but {world} processes "
                         f"were launched; launch {grid.size} or change the sizes so their product is {world}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    # After an elastic restart (torchrun --max-restarts) torchrun's store still holds the failed
    # attempt's keys (peer addresses, the failure record): each attempt keeps to its own, and so does
    # each join of one process (a task that runs several groups in turn, as tasks.pipeline's schedules).
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"attempt-{restart}-{next(_JOINS)}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    # NCCL requires the first call on a group to involve every rank; batched p2p may not.
    dist.all_reduce(torch.zeros(1, device=device))
    watch = FailureWatch(store, rank, world, dead_after_s=dead_after_s).start()
    return DistContext(rank, world, device, store, watch, build_grid(grid, timeout=timeout))


def close_distributed(ctx: DistContext) -> None:
    """Leave the group once every rank is done; rank 0 may host the store the others still use."""
    ctx.watch.stop()  # first: a rank that finishes and exits early must not look like a failure
    dist.barrier()
    dist.destroy_process_group()


def run_in_group(backend: str | None, fn: Callable[..., Any], *args: Any) -> Any:
    """For spawned workers: join (the default grid), ``fn(rank, world_size, *args)`` under the failure
    watch, leave. ``spawn(run_in_group, n, ("gloo", fn, ...))`` runs ``fn`` on ``n`` ranks."""
    ctx = init_distributed(backend=backend)
    with ctx.guard():
        ctx.where = f"{getattr(fn, '__qualname__', fn)}"
        result = fn(ctx.rank, ctx.world_size, *args)
    close_distributed(ctx)
    return result
