"""The process and the machine it runs on, as a plan and a run see them: the CUDA allocator's setting, a cap on this
process's GPU memory, glibc returning freed memory, this process's resident memory and the host's available memory,
and what CUDA's libraries add to a process. The model's bytes are ``footprint.py``'s.
"""
from __future__ import annotations

import os

import torch

GIB = 2**30


def allocator_setting() -> tuple[bool, str]:
    """Whether the CUDA caching allocator will use expandable segments in this process, and a line that says
    so and why: nanotrain turns them on (``use_expandable_segments``) unless ``PYTORCH_CUDA_ALLOC_CONF`` (or
    ``PYTORCH_ALLOC_CONF``) was given.

    Without them the allocator keeps freed blocks in fixed segments: a GPT-2-shaped 6.6B streamed plan that
    peaked at 22.7 GiB allocated ran out of a 24 GiB cap with 2.2 GiB reserved but unallocated. With them it
    maps pages into growing segments, so freed memory serves any later size (plans then keep 3% free, not
    12%: ``margin``)."""
    given = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    if given is None or given == _EXPANDABLE and os.environ.get(_SET_BY_US):
        return True, "allocator: expandable segments, set by nanotrain (PYTORCH_CUDA_ALLOC_CONF was unset)"
    on = "expandable_segments:true" in given.replace(" ", "").lower()
    return on, f"allocator: PYTORCH_CUDA_ALLOC_CONF={given} as given (expandable segments {'on' if on else 'off'})"


_EXPANDABLE, _SET_BY_US = "expandable_segments:True", "NANOTRAIN_SET_ALLOC_CONF"


def use_expandable_segments() -> tuple[bool, str]:
    """``allocator_setting``, after turning expandable segments on where the user left the allocator alone.
    Call it before CUDA allocates anything (processes started later inherit the setting)."""
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") is None and os.environ.get("PYTORCH_ALLOC_CONF") is None:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"], os.environ[_SET_BY_US] = _EXPANDABLE, "1"
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # too late for the variable alone
            torch.cuda.memory._set_allocator_settings(_EXPANDABLE)
    return allocator_setting()


def set_gpu_cap(gib: float | None, device: torch.device | int = 0) -> None:
    """Enforce a cap on this process's CUDA memory (an overshoot raises out-of-memory); None lifts it."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if gib is None else min(1.0, gib * GIB / total), device)


def return_freed_memory_to_the_os() -> None:
    """Make glibc give large freed blocks back to the kernel at once (Linux; a no-op elsewhere).

    glibc raises its mmap threshold to the size of the largest block freed so far (up to 32 MB), so
    after the first freed tensor, tensors below 32 MB come from the heap, and freeing them leaves
    holes that still count as RSS. Loading gpt2-xl (whose 31 MB qkv weights are such tensors) into
    the streaming optimizer then left 1.8 GiB of such holes in one run out of two. A fixed
    threshold of 1 MB keeps every tensor-sized block mmap-backed, so freeing it frees it.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_MMAP_THRESHOLD = -3
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)


def host_rss_gib() -> tuple[float, float]:
    """(current, peak) resident memory of this process in GiB; pinned buffers are resident, so included."""
    fields = {}
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024 / GIB
    return fields.get("VmRSS", float("nan")), fields.get("VmHWM", float("nan"))


def host_available() -> int:
    """The host's available memory in bytes (``MemAvailable``); where it cannot be read, taken as enough."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


# What a training process's RSS adds to the process a plan measured, its CUDA context made (its host link timed):
# the libraries loaded at first use (cuBLAS, cuDNN, kernel images: 0.33 GiB in a probe of matmuls and attention), the
# data and the loop. Eager, warm compile cache, one H200, torch 2.11 (2026-11-28): llama-3.2-1b resident 1.02 ->
# 1.63 GiB, gpt2-large 1.01 -> 1.55. (It was 2.25 GiB, context and all, counted beside a process that had both.)
CUDA_RUNTIME_BYTES = int(0.6 * GIB)
# The context and the link measurement's pinned buffers (0.12 + 0.25 GiB in that probe): what a rank holds that the
# launcher that plans for it, without CUDA, does not (``plan.run.box``).
CUDA_CONTEXT_BYTES = int(0.37 * GIB)
