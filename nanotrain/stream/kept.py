"""A deferred step's gradients, kept until the step's verdict (``stream.deferred``: why, and its cost)."""
from __future__ import annotations

from typing import Any

import torch

from nanotrain.stream.pinned import HostArena
def norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's 2-norm in fp32, on the device (no sync)."""
    return [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]


class KeptGrads:
    """Host copies of some units' fp32 gradients for one step (``numels``: each unit's, flat), and the
    step's norms so far. ``opt`` (a ``StreamedAdam``, whose ``kept_grads`` makes this) updates the units
    once the step's verdict is known."""

    def __init__(self, opt: Any, numels: dict[str, list[int]]):
        self.opt, self.device, self.clock = opt, opt.device, opt.clock
        self._cuda = self.device.type == "cuda"
        self.arena = HostArena(HostArena.size_of([(n, torch.float32) for ns in numels.values() for n in ns]),
                               pin=self._cuda)
        self.host = {unit: [self.arena.take(n, torch.float32) for n in ns] for unit, ns in numels.items()}
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._copied: torch.cuda.Event | None = None
        self._norms: list[torch.Tensor] = []

    def count(self, unit: str, grads: list[torch.Tensor]) -> None:
        """``unit``'s final gradients, which stay where they are: add them to the step's norm (no sync)."""
        self._norms += norms(grads)

    def keep(self, unit: str, grads: list[torch.Tensor]) -> None:
        """Count ``unit``'s final gradients and start copying them to host memory."""
        self._norms += norms(grads)
        self._copy_out(unit, grads)

    def _copy_out(self, unit: str, grads: list[torch.Tensor]) -> None:
        if not self._cuda:
            for h, g in zip(self.host[unit], grads):
                h.copy_(g.view(-1))
            return
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(compute)  # the gradients are final there
            for h, g in zip(self.host[unit], grads):
                h.copy_(g.view(-1), non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(self._stream)

    def reusable(self) -> None:
        """Make the compute stream wait until the gradients kept last are copied: their buffers may be reused."""
        self.clock.wait(self._copied)

    def bring(self, unit: str, out: list[torch.Tensor]) -> None:
        """Copy ``unit``'s kept gradients into ``out`` (device buffers), in order on the compute stream."""
        self.reusable()
        for o, h in zip(out, self.host[unit]):
            o.view(-1).copy_(h, non_blocking=True)

    def norm(self) -> torch.Tensor:
        """The global norm of everything counted since the last call (as ``train.clip.global_norm``)."""
        counted, self._norms = self._norms, []
        return torch.stack(counted).square().sum().sqrt()

    def update(self, unit: str, slot, grads: list[torch.Tensor], factor: torch.Tensor | None) -> None:
        """Update ``unit`` (loaded into ``slot`` with its states) with its gradients ``grads`` (device buffers,
        filled here when kept in host memory) times ``factor``."""
        if unit in self.host:
            self.bring(unit, grads)
        self.opt.update(slot, grads if factor is None else [g.mul_(factor) for g in grads])

    def close(self) -> None:
        self.arena.close()
