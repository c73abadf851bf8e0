"""Autograd-free point-to-point transport: one ``batch_isend_irecv`` per planned batch.

Shapes are known from the partition, so nothing but the tensors themselves is exchanged.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from nanotrain.pipeline.comm_plan import Op


class Batch:
    """Posted sends and receives; holds their tensors until they are done."""

    def __init__(self, ops: list[tuple[Op, torch.Tensor]], global_rank: Callable[[int], int],
                 rank_name: Callable[[int], str]):
        self.ops = ops
        self._name = rank_name
        # Peers are pp ranks; point-to-point ops address global ranks.
        self._works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend if op.send else dist.irecv, t, global_rank(op.peer)) for op, t in ops])

    def done(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        try:
            for w in self._works:
                w.wait()
        except Exception as e:
            what = "; ".join(f"{'send' if op.send else 'recv'} {op.msg} {'to' if op.send else 'from'} "
                             f"{self._name(op.peer)}" for op, _ in self.ops)
            raise RuntimeError(f"point-to-point batch [{what}] failed (is that rank alive?): {e}") from e
        self._works = []
