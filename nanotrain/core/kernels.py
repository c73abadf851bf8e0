"""``fused``: a function compiled by ``torch.compile`` where that serves, the function itself elsewhere.

Memory-bound chains of elementwise ops (the LM head's softmax, the 8-bit moments' quantization)
read and write their whole operand once per op in eager mode; compiled, they become one or two
passes. Compiled only on CUDA devices Triton supports (compute capability 7.0 and up): on the CPU,
where the tests run, and on older GPUs the plain function runs and gives the same numbers up to
float rounding.
"""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn)


@functools.cache
def _compiles_on(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (7, 0)


def fused(fn: F, device: torch.device) -> F:
    """``fn`` compiled for a CUDA ``device`` Triton supports, else ``fn`` unchanged."""
    if device.type == "cuda" and _compiles_on(device.index if device.index is not None else 0):
        return _compiled(fn)
    return fn
