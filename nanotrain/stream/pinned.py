"""Page-locked host memory of exactly the size asked for.

``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds
every block up to a power of two: a 41 MB fp32 MLP weight of GPT-2-XL takes 64 MB of locked RAM,
and a model's worth of such buffers would overshoot a 16 GiB host budget by gigabytes. An arena
is one ordinary allocation, page-aligned and registered with ``cudaHostRegister``, so copies from
and to it are asynchronous DMA while RSS grows by its size only. Tensors are carved out of it as
views. Without CUDA it is plain memory (the CPU-as-device tests use it that way).
"""
from __future__ import annotations

import torch

from nanotrain.monitor.steptime import StepClock

PAGE = 4096
_ALIGN = 64  # bytes between carved tensors: keeps every view aligned for vectorised CPU math


def _code(err) -> int:
    """A cudaError_t as an int (torch's binding returns an enum; its int form differs by version)."""
    return int(getattr(err, "value", err))


class HostArena:
    """``nbytes`` of host memory, locked for DMA when ``pin`` (and CUDA) is on; hands out views."""

    def __init__(self, nbytes: int, pin: bool):
        # PAGE bytes of slack so the aligned region's pages belong to this allocation alone: two
        # registrations may not share a page.
        self._raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
        start = -self._raw.data_ptr() % PAGE
        self.buffer = self._raw[start:start + nbytes]
        self._used = 0
        self.pinned = False
        if pin and nbytes and torch.cuda.is_available():
            err = _code(torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), nbytes, 0))
            if err != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes / 2**20:.0f} MiB failed with CUDA error {err}; "
                                   f"is the locked-memory limit (ulimit -l) too low?")
            self.pinned = True

    @staticmethod
    def size_of(shapes_dtypes: list[tuple[int, torch.dtype]]) -> int:
        """Bytes an arena needs to carve tensors of these element counts and dtypes."""
        total = 0
        for n, dtype in shapes_dtypes:
            total = -(-total // _ALIGN) * _ALIGN + n * torch.empty((), dtype=dtype).element_size()
        return total

    def take(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The next ``n`` elements of ``dtype`` as a flat tensor (contents undefined)."""
        size = torch.empty((), dtype=dtype).element_size()
        start = -(-self._used // _ALIGN) * _ALIGN
        end = start + n * size
        if end > self.buffer.numel():
            raise ValueError(f"arena of {self.buffer.numel()} bytes cannot hold {n} more {dtype} elements")
        self._used = end
        return self.buffer[start:end].view(dtype)

    def close(self) -> None:
        """Unlock the pages (the memory itself goes when the last view of it does)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: CUDA may be gone already
            pass


class WaitClock:
    """Makes the compute stream wait for a copy's event, without syncing the host; once a trainer sets
    ``steps``, each wait is timed there as its step's ``copy_wait``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.steps: StepClock | None = None

    def wait(self, event: torch.cuda.Event | None) -> None:
        if self.steps is not None:
            self.steps.wait(event)
        elif event is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(event)
