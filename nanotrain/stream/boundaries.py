"""Block inputs of every micro-batch, kept for the backward pass on the device or in host memory.

The streaming trainer runs the whole batch through one block before the next (see
``nanotrain.stream.trainer``), so it keeps the input of every block for every micro-batch: the only
activations that outlive a block. Boundaries ``0 .. on_host - 1`` go to host memory (a locked arena
allocated once): they are written first in the forward pass and read last in the backward pass,
which leaves their copies the most time to hide. A host boundary comes back into one of two
device staging buffers, prefetched one block ahead of its use.
"""
from __future__ import annotations

import torch

from nanotrain.stream.pinned import HostArena, WaitClock


class BoundaryStore:
    """``put``/``get``/``drop`` boundary ``j`` of micro-batch ``m`` (tensors of ``shape`` each)."""

    def __init__(self, n_boundaries: int, n_micro: int, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, on_host: int, clock: WaitClock):
        if not 0 <= on_host <= n_boundaries:
            raise ValueError(f"on_host={on_host} must be within [0, {n_boundaries}]")
        self.n_micro, self.shape, self.dtype, self.device, self.on_host = n_micro, shape, dtype, device, on_host
        self.clock = clock
        self._cuda = device.type == "cuda"
        self._kept: dict[tuple[int, int], torch.Tensor] = {}
        numel = n_micro * int(torch.Size(shape).numel())
        self.arena = HostArena(HostArena.size_of([(numel, dtype)] * on_host), pin=self._cuda)
        self._host = [self.arena.take(numel, dtype).view(n_micro, *shape) for _ in range(on_host)]
        self._staging = [torch.empty(n_micro, *shape, dtype=dtype, device=device) for _ in range(min(on_host, 2))]
        self._written: dict[int, torch.cuda.Event] = {}
        self._ready: dict[int, torch.cuda.Event | None] = {}
        self._free: dict[int, torch.cuda.Event | None] = {}
        if self._cuda:
            self._d2h, self._h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def reuse(self, shape: tuple[int, ...]) -> bool:
        """Whether this store serves a step of boundaries of ``shape`` (its host arena locked once): then it forgets
        what a previous (possibly skipped) step left behind; else it is closed, for one of the new shape."""
        if shape != self.shape:
            self.close()
            return False
        self._kept.clear()
        self._ready.clear()
        return True

    def put(self, j: int, m: int, x: torch.Tensor) -> None:
        if j >= self.on_host:
            self._kept[j, m] = x
            return
        if not self._cuda:
            self._host[j][m].copy_(x)
            return
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._d2h):
            self._d2h.wait_stream(compute)
            self._host[j][m].copy_(x, non_blocking=True)
            x.record_stream(self._d2h)  # the caller drops x while the copy may still run
            if m == self.n_micro - 1:
                self._written[j] = torch.cuda.Event()
                self._written[j].record(self._d2h)

    def prefetch(self, j: int) -> None:
        """Start bringing host boundary ``j`` back (a no-op for device boundaries)."""
        if j < 0 or j >= self.on_host or j in self._ready:
            return
        buf = self._staging[j % 2]
        if not self._cuda:
            buf.copy_(self._host[j])
            self._ready[j] = None
            return
        with torch.cuda.stream(self._h2d):
            for event in (self._free.pop(j % 2, None), self._written.pop(j, None)):
                if event is not None:
                    self._h2d.wait_event(event)
            buf.copy_(self._host[j], non_blocking=True)
            self._ready[j] = torch.cuda.Event()
            self._ready[j].record(self._h2d)

    def get(self, j: int, m: int) -> torch.Tensor:
        if j >= self.on_host:
            return self._kept[j, m]
        self.prefetch(j)
        self.clock.wait(self._ready[j])
        return self._staging[j % 2][m]

    def drop(self, j: int, m: int) -> None:
        """Micro-batch ``m`` is done with boundary ``j``."""
        if j >= self.on_host:
            del self._kept[j, m]
        elif m == self.n_micro - 1:
            del self._ready[j]
            if self._cuda:
                self._free[j % 2] = torch.cuda.Event()
                self._free[j % 2].record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        self.arena.close()


def store_for(old: BoundaryStore | None, n_boundaries: int, n_micro: int, shape: tuple[int, ...],
              dtype: torch.dtype, device: torch.device, on_host: int, clock: WaitClock) -> BoundaryStore:
    """``old`` when it serves boundaries of ``shape`` (``BoundaryStore.reuse``); else a new store."""
    if old is not None and old.reuse(shape):
        return old
    return BoundaryStore(n_boundaries, n_micro, shape, dtype, device, on_host, clock)
