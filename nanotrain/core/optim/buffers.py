"""What ``OffloadAdam`` keeps for each unit, and where: the fp32 masters (taken over from the caller's leaves or
copied), the moments (32- or 8-bit per leaf), the weights the model computes with on the device (tensors of their
own, or a caller's: data parallelism's all-gather input), a second copy of masters and moments for exact skips, and
with offload the pinned host buffers a gradient comes down to and new weights go up from."""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import torch

from nanotrain.core.optim.adam import AdamState, init_state
from nanotrain.core.optim.units import OffloadConfig


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Whether no element of ``tensors`` is inf or NaN, as a tensor where they are: from their fp32 sums, one read
    of each and no temporary of its size (``isfinite(t).all()`` makes three, 12% of an 8B ZeRO-3 step and the 2 GiB
    that ran a 7B rank out of memory). A sum is non-finite whenever an element is; it is also where finite values
    sum past 3.4e38, which no gradient of a training that still trains reaches: that step is skipped."""
    return torch.isfinite(torch.stack([t.sum(dtype=torch.float32) for t in tensors]).sum())


@dataclass
class UnitBuffers:
    name: str
    paths: list[str]
    device: list[torch.Tensor]         # the weights the model computes with (leaves of ``OffloadAdam.params``)
    master: list[torch.Tensor]         # flat fp32, committed
    state: list[AdamState]
    shadow: tuple[list[torch.Tensor], list[AdamState]] | None  # where an exact-skip step writes
    grad_host: list[torch.Tensor] = field(default_factory=list)  # flat, pinned on CUDA (offload)
    staging: list[torch.Tensor] = field(default_factory=list)    # flat new weights to upload (offload)
    finite_host: torch.Tensor | None = None
    job: concurrent.futures.Future | None = None
    uploaded: torch.cuda.Event | None = None


def master_of(t: torch.Tensor, home: torch.device, copy: bool) -> torch.Tensor:
    """The flat fp32 master of ``t`` on ``home``: never sharing ``t``'s memory unless ``copy`` is False."""
    flat = t.detach().to(home, torch.float32).flatten()
    shares = flat.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    return flat.clone() if copy and shares else flat


def make_unit(name: str, paths: list[str], leaves: dict[str, torch.Tensor], cfg: OffloadConfig, home: torch.device,
              device: torch.device, copy: bool, pin: bool,
              device_weights: dict[str, torch.Tensor] | None = None) -> UnitBuffers:
    """Unit ``name``'s buffers for its ``leaves`` (by path): masters and moments on ``home``, the compute weights on
    ``device`` (into ``device_weights`` where given), host buffers pinned with ``pin``."""
    into = device_weights or {}
    master = [master_of(leaves[p], home, copy) for p in paths]
    bits = [cfg.moment_bits(p, m.numel()) for p, m in zip(paths, master)]
    weights = [into[p].copy_(leaves[p].detach().reshape(into[p].shape)) if p in into else
               leaves[p].detach().to(device, cfg.dtype).contiguous().clone() for p in paths]
    new_state = lambda: [init_state(m, b, cfg.block) for m, b in zip(master, bits)]  # noqa: E731
    shadow = ([m.clone() for m in master], new_state()) if cfg.exact_skip else None
    unit = UnitBuffers(name, paths, weights, master, new_state(), shadow)
    if cfg.offload:
        host = lambda dt: [torch.empty(m.numel(), dtype=dt, pin_memory=pin) for m in master]  # noqa: E731
        unit.grad_host, unit.staging = host(cfg.grad_dtype), host(cfg.dtype)
        unit.finite_host = torch.empty((), dtype=torch.bool, pin_memory=pin)
    return unit
