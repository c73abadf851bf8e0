"""Start a group of ranks on one machine without torchrun: CPU tests and demos.

``spawn(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh
processes with torch.distributed initialised (gloo on CPU, NCCL with one GPU per rank), and
re-raises the first failure with its traceback.
"""
from __future__ import annotations

import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str, threads: int,
            args: tuple) -> None:
    # Spawned ranks share the machine's cores; more threads than cores make gloo runs crawl.
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", threads: int = 1) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; ``fn`` must be importable (top level)."""
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend nccl needs one GPU per rank: {world_size} ranks, "
                         f"{torch.cuda.device_count()} GPUs visible; use fewer ranks or backend='gloo'")
    mp.spawn(_worker, args=(fn, world_size, free_port(), backend, threads, args), nprocs=world_size, join=True)
