"""How much GPU memory a fine-tuning plan needs, and the largest micro-batch a cap allows.

An estimate from the model's shapes, so a plan that cannot fit is refused before anything is
allocated (and testable without a GPU). The per-token activation figures are bytes per token per
layer for bf16 compute with fused attention (Korthikanti et al. 2022 count 34·C for a block);
the GPU runs check the estimate against ``torch.cuda.max_memory_allocated``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from nanotrain.checkpointing import CheckpointPolicy
from nanotrain.config import GPT2Config

GIB = 2**30
_ACT_PER_TOKEN_LAYER = {"none": 34, "lean": 22, "selective": 18, "every": 2}  # x C x (dtype bytes / 2)
_ALLOCATOR_SLACK = 1.10  # fragmentation and cuBLAS/cuDNN workspaces


@dataclass(frozen=True)
class MemoryPlan:
    micro_batch: int
    weights: int      # low-precision weights the GPU computes with
    grad_accum: int   # fp32 gradient accumulation buffers
    activations: int  # saved activations of one micro-batch, plus one block being recomputed
    head: int         # one chunk of the fused LM-head loss
    total: int

    def describe(self) -> str:
        return (f"micro-batch {self.micro_batch}: weights {self.weights / GIB:.2f} + gradient accumulation "
                f"{self.grad_accum / GIB:.2f} + activations {self.activations / GIB:.2f} + LM head "
                f"{self.head / GIB:.2f} GiB, with allocator slack {self.total / GIB:.2f} GiB")


def estimate(cfg: GPT2Config, micro_batch: int, seq: int, policy: CheckpointPolicy, dtype_bytes: int = 2,
             chunk_tokens: int = 2048) -> MemoryPlan:
    n = cfg.num_params()
    c, tokens = cfg.n_embd, micro_batch * seq
    scale = dtype_bytes / 2
    if policy.kind == "every-k":
        kept = cfg.n_layer - len(range(0, cfg.n_layer, policy.k))
        per_layer_sum = (kept * 34 + (cfg.n_layer - kept) * 2) * c
    else:
        per_layer_sum = cfg.n_layer * _ACT_PER_TOKEN_LAYER[policy.kind] * c
    recompute_one_block = 34 * c * tokens * scale if policy.kind not in ("none", "lean") else 0
    activations = int(tokens * per_layer_sum * scale + recompute_one_block)
    vocab = -(-cfg.vocab_size // 64) * 64
    chunk = min(chunk_tokens, tokens)
    head = int(chunk * vocab * (4 + dtype_bytes) + vocab * c * 4 + tokens * c * dtype_bytes)
    weights, grad_accum = n * dtype_bytes, n * 4
    total = int((weights + grad_accum + activations + head) * _ALLOCATOR_SLACK)
    return MemoryPlan(micro_batch, weights, grad_accum, activations, head, total)


def choose_micro_batch(cfg: GPT2Config, batch: int, seq: int, policy: CheckpointPolicy, cap_bytes: int,
                       dtype_bytes: int = 2) -> MemoryPlan:
    """The largest micro-batch dividing ``batch`` whose estimate fits under ``cap_bytes``."""
    for mb in sorted((d for d in range(1, batch + 1) if batch % d == 0), reverse=True):
        plan = estimate(cfg, mb, seq, policy, dtype_bytes)
        if plan.total <= cap_bytes:
            return plan
    smallest = estimate(cfg, 1, seq, policy, dtype_bytes)
    raise MemoryError(f"a GPU cap of {cap_bytes / GIB:.2f} GiB cannot fit this model with checkpointing "
                      f"{policy.kind!r}: the minimum is {smallest.total / GIB:.2f} GiB ({smallest.describe()}). "
                      f"Raise --gpu-mem-gib, use --checkpoint every, or a shorter --seq")


def set_gpu_cap(gib: float | None, device: torch.device | int = 0) -> None:
    """Enforce a cap on this process's CUDA memory (an overshoot raises out-of-memory); None lifts it."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if gib is None else min(1.0, gib * GIB / total), device)


def host_rss_gib() -> tuple[float, float]:
    """(current, peak) resident memory of this process in GiB; pinned buffers are resident, so included."""
    fields = {}
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024 / GIB
    return fields.get("VmRSS", float("nan")), fields.get("VmHWM", float("nan"))
