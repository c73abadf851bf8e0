"""The process group a pipeline runs in, built once from torchrun's variables and passed explicitly.

Single node: ``torchrun --nproc-per-node 4 -m tasks.pipeline ...``. Several nodes: run on
every node ``torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d
--rdzv-endpoint HOST:29500 --rdzv-id JOB -m tasks.pipeline ...`` with HOST reachable from all
nodes; ranks are numbered node by node, so consecutive stages share a node where possible.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from nanotrain.pipeline.failure import FailureWatch, failures_reported

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class PipeContext:
    rank: int
    world_size: int
    device: torch.device
    store: dist.Store
    watch: FailureWatch
    where: str = field(default="setup")  # what this rank is doing, for error messages

    def guard(self):
        """``with ctx.guard():`` any exception stops every rank with this rank's name and ``where``."""
        return failures_reported(self.watch, lambda: self.where)


def init_pipeline(backend: str | None = None, timeout_s: float = 120.0) -> PipeContext:
    """Join the process group described by RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK).

    ``backend`` defaults to NCCL when CUDA is available, else gloo. ``timeout_s`` bounds every
    collective and point-to-point wait, so a lost peer is an error rather than a hang.
    """
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(f"environment variables {', '.join(missing)} are not set: launch with torchrun "
                           f"(torchrun --nproc-per-node N -m ...) or nanotrain.pipeline.spawn.spawn")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    # NCCL requires the first call on a group to involve every rank; batched p2p may not.
    dist.all_reduce(torch.zeros(1, device=device))
    return PipeContext(rank, world, device, store, FailureWatch(store, rank).start())


def close_pipeline(ctx: PipeContext) -> None:
    """Leave the group once every rank is done; rank 0 may host the store the others still use."""
    ctx.watch.stop()  # first: a rank that finishes and exits early must not look like a failure
    dist.barrier()
    dist.destroy_process_group()
