"""How much GPU memory a fine-tuning plan needs, and the largest micro-batch a cap allows.

An estimate from the model's cost table (``ModelSpec.costs``), so a plan that cannot fit is refused
before anything is allocated (and testable without a GPU). Activations are the table's bytes per token
per block by recompute policy (bf16 compute, fused attention); the GPU runs check the estimate against
``torch.cuda.max_memory_allocated``.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from nanotrain.memory.recompute import RecomputePolicy
from nanotrain.models import model_spec
from nanotrain.models.spec import Costs, ModelSpec

GIB = 2**30
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


def _logits_vocab(costs: Costs) -> int:
    """The vocabulary as the LM head's logits chunk holds it (padded to 64)."""
    return -(-costs.vocab // 64) * 64


def fp32_moment_params(spec: ModelSpec) -> int:
    """Parameters whose moments stay 32-bit under 8-bit moments (``spec.fp32_moments``: the embeddings)."""
    return sum(math.prod(spec.leaf(path).shape) for path in spec.fp32_moments)


def estimate(cfg: Any, micro_batch: int, seq: int, policy: RecomputePolicy, dtype_bytes: int = 2,
             chunk_tokens: int = 2048) -> MemoryPlan:
    """The GPU bytes of a resident run of ``cfg`` (any family's config, or its spec)."""
    costs = model_spec(cfg).costs
    n, c, tokens = costs.total_params, costs.width, micro_batch * seq
    scale = dtype_bytes / 2
    if policy.kind == "every-k":
        kept = costs.n_layer - len(range(0, costs.n_layer, policy.k))
        per_layer_sum = kept * costs.activation_bytes("none") + (costs.n_layer - kept) * costs.activation_bytes("every")
    else:
        per_layer_sum = costs.n_layer * costs.activation_bytes(policy.kind)
    recompute_one_block = costs.recompute_bytes * tokens * scale if policy.kind not in ("none", "lean") else 0
    activations = int(tokens * per_layer_sum * scale + recompute_one_block)
    vocab = _logits_vocab(costs)
    chunk = min(chunk_tokens, tokens)
    head = int(chunk * vocab * (4 + dtype_bytes) + vocab * c * 4 + tokens * c * dtype_bytes)
    weights, grad_accum = n * dtype_bytes, n * 4
    total = int((weights + grad_accum + activations + head) * _ALLOCATOR_SLACK)
    return MemoryPlan(micro_batch, weights, grad_accum, activations, head, total)


def micro_batches(batch: int, most: int | None = None) -> list[int]:
    """The micro-batch sizes that divide ``batch`` (up to ``most``), smallest first."""
    return [d for d in range(1, min(batch, most or batch) + 1) if batch % d == 0]


def choose_micro_batch(cfg: Any, batch: int, seq: int, policy: RecomputePolicy, cap_bytes: int,
                       dtype_bytes: int = 2) -> MemoryPlan:
    """The largest micro-batch dividing ``batch`` whose estimate fits under ``cap_bytes``."""
    for mb in reversed(micro_batches(batch)):
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


# ---------------------------------------------------------------------------------------------
# Weight streaming (``nanotrain.train.streamed``): a device budget and a host budget.

# What CUDA's context and libraries (cuBLAS, cuDNN, kernel images), loaded at first use, add to a
# training process's RSS: 2.2 GiB measured on an H200 with torch 2.11.
CUDA_RUNTIME_BYTES = int(2.25 * GIB)
# Plans leave 5% of the GPU cap free: the caching allocator held 0.7 GiB reserved but unallocated
# when a gpt2-xl plan that the estimate put at 10.8 GiB ran out of an 11 GiB cap.
_CAP_HEADROOM = 0.95
# A block's backward temporaries beside its recomputed activations, in bytes per token at 2 bytes an element,
# in units of the width: the gradients of the widest activations. Fitted with ``recompute_bytes`` (34 C) to
# gpt2-xl at micro-batch 8 (fits) and 16 (ran out of an 11 GiB cap), H200, torch 2.11: 60 C together.
_BACKWARD_TEMPS = 26


@dataclass(frozen=True)
class StreamPlan:
    micro_batch: int
    on_host: int        # block inputs kept in host memory (the rest stay on the device)
    device_bytes: int
    host_bytes: int     # optimizer state + host boundaries + the process before training
    detail: str

    def describe(self) -> str:
        return (f"micro-batch {self.micro_batch}, {self.on_host} block inputs in host memory: device "
                f"{self.device_bytes / GIB:.2f} GiB, host {self.host_bytes / GIB:.2f} GiB ({self.detail})")


def _stream_estimate(cfg: Any, batch: int, seq: int, mb: int, on_host: int, state_bits: int,
                     dtype_bytes: int, base_rss: int, tail: int = 0, tail_mb: int | None = None,
                     chunk_tokens: int = 2048, shards: int = 1, deferred: bool = False) -> StreamPlan:
    costs = model_spec(cfg).costs
    c, n_layer, block = costs.width, costs.n_layer - tail, costs.block_params  # n_layer: the layer-major blocks
    blocks_total = costs.n_layer * block
    ends = costs.total_params - blocks_total  # the embedding and head units, on the device all step
    boundary = batch * seq * c * dtype_bytes
    kept = n_layer + 1 - on_host + min(on_host, 2)          # kept on the device, the top one, staging
    moments8 = 2 + 8 / 2048                                  # bytes per parameter: two codes + block scales
    block_moments = moments8 if state_bits == 8 else 8
    # Sharded over data-parallel ranks (``data_parallel/streamed.py``), a slot holds 1/N of a unit's masters
    # and moments, and its update a whole fp32 gradient laid out flat (shared by the units of one layout).
    slots = (2 + (tail > 0)) * block * ((4 + block_moments) / shards + dtype_bytes) + block * 4  # + fp32 gradient
    slots += tail * block * (dtype_bytes + 4)  # the tail's weights and fp32 gradients, there all step
    ends_dev = ends * ((4 + 8) / shards + dtype_bytes + 4)            # masters, 32-bit moments, weights, gradient
    if shards > 1:
        slots, ends_dev = slots + block * 4, ends_dev + ends * 4
    # One micro-batch's block being recomputed and back-propagated: its activations (``recompute_bytes``), the
    # gradients of the widest ones on top (``_BACKWARD_TEMPS``), and the block's bf16 weight gradients.
    work = (costs.recompute_bytes + _BACKWARD_TEMPS * c) * mb * seq * dtype_bytes // 2 + block * dtype_bytes
    vocab = _logits_vocab(costs)
    head = min(chunk_tokens, mb * seq) * vocab * (4 + dtype_bytes) + vocab * c * (4 + dtype_bytes)
    acts = kept * boundary + boundary  # the kept boundaries and the gradient flowing down
    # A pass through the tail keeps every tail block's activations, and one block's backward temporaries.
    tail_acts = tail * costs.activation_bytes("none") + _BACKWARD_TEMPS * c
    head += tail_acts * (tail_mb or mb) * seq * dtype_bytes // 2 if tail else 0
    # The LM head runs before the first block's backward, so its memory and one block's never overlap.
    device = int((acts + slots + ends_dev + max(work, head)) * _ALLOCATOR_SLACK)
    # The rest (embeddings, norms) keep 32-bit moments: 12 bytes per parameter with the master. Sharded,
    # a rank keeps 1/N of them and a whole copy of the weights in the compute dtype.
    state = int(blocks_total * (4 + block_moments) + ends * 12) // shards
    state += costs.total_params * dtype_bytes if shards > 1 else 0
    # Clipping or fp16 (train.deferred): the layer-major blocks' fp32 gradients wait in host memory; sharded,
    # every unit's reduced shard does (data_parallel.deferred).
    kept = (n_layer * block if shards == 1 else costs.total_params) * 4 // shards if deferred else 0
    host = state + on_host * boundary + kept + base_rss
    kept_text = f"kept gradients{f' (1/{shards})' if shards > 1 else ''} {kept / GIB:.2f} + " if kept else ""
    detail = (f"{tail} top blocks as a tail; " if tail else "") + (
        f"device: boundaries {acts / GIB:.2f} + streamed units {(slots + ends_dev) / GIB:.2f} + one micro-batch's "
        f"block {work / GIB:.2f} + LM head {head / GIB:.2f}; host: masters and moments"
        f"{f' (1/{shards}) and weights' if shards > 1 else ''} {state / GIB:.2f} + "
        f"boundaries {on_host * boundary / GIB:.2f} + " + kept_text
        + f"process {base_rss / GIB:.2f}")
    return StreamPlan(mb, on_host, device, host, detail)


def plan_streaming(cfg: Any, batch: int, seq: int, gpu_cap: int, host_cap: int | None, state_bits: int,
                   dtype_bytes: int = 2, micro_batch: int | None = None, base_rss: int = 0,
                   max_micro_batch: int = 16, tail: int = 0, tail_mb: int | None = None,
                   shards: int = 1, deferred: bool = False) -> StreamPlan:
    """The largest micro-batch (up to ``max_micro_batch``) and fewest host boundaries that fit both caps.
    ``batch`` is this process's part of the batch; ``shards``: data-parallel ranks sharing the state;
    ``deferred``: clipping or fp16, whose steps keep the blocks' gradients in host memory."""
    mbs = [micro_batch] if micro_batch else micro_batches(batch, max_micro_batch)[::-1]
    n_layer = model_spec(cfg).n_layer
    best = None
    for mb in mbs:
        if tail_mb and mb % tail_mb:
            continue
        for on_host in range(n_layer - tail + 1):
            plan = _stream_estimate(cfg, batch, seq, mb, on_host, state_bits, dtype_bytes, base_rss, tail, tail_mb,
                                    shards=shards, deferred=deferred)
            if plan.device_bytes <= _CAP_HEADROOM * gpu_cap:
                if host_cap is None or plan.host_bytes <= host_cap:
                    return plan
                best = best or plan
                break
    least = best or _stream_estimate(cfg, batch, seq, mbs[-1], n_layer - tail, state_bits, dtype_bytes, base_rss,
                                     tail, tail_mb, shards=shards, deferred=deferred)
    host = "no host cap" if host_cap is None else f"a host cap of {host_cap / GIB:.2f} GiB"
    hint = " Try --adam-bits 8." if state_bits == 32 else ""
    raise MemoryError(f"streaming cannot fit {_CAP_HEADROOM:.0%} of a GPU cap of {gpu_cap / GIB:.2f} GiB with "
                      f"{host}: the closest plan needs {least.describe()}. Raise a cap, or lower --batch or "
                      f"--seq.{hint}")


# ---------------------------------------------------------------------------------------------
# The resident trainer's host memory: its optimizer state, and without a GPU everything else too.

@dataclass(frozen=True)
class HostPlan:
    total: int
    detail: str

    def describe(self) -> str:
        return f"{self.total / GIB:.2f} GiB ({self.detail})"


def plan_resident_host(cfg: Any, micro_batch: int, seq: int, policy: RecomputePolicy, state_bits: int,
                       states_on_host: bool, on_gpu: bool, base_rss: int = 0, fp16: bool = False,
                       shards: int = 1, exact_skip: bool = False) -> HostPlan:
    """Host memory of a resident run: with ``states_on_host``, fp32 masters, moments and the offloaded
    optimizer's gradient and staging copies; without a GPU, also the weights computed with, their
    fp32 gradient sums and the activations (``estimate`` at 4 bytes); with one, CUDA's libraries.
    ``fp16``: gradients travel in fp32; ``exact_skip``: a second copy of masters and moments (clipping that
    keeps the overlap, ``optim.clip_redo``, and fp16 under data parallelism);
    ``shards``: ZeRO ranks sharing the optimizer state (each holds 1/N of it)."""
    spec = model_spec(cfg)
    n, fp32 = spec.costs.total_params, fp32_moment_params(spec)
    moments = 8 * fp32 + (n - fp32) * (2 + 8 / 2048 if state_bits == 8 else 8)
    weight_bytes = 2 if on_gpu or fp16 else 4
    copies = ((4 if fp16 else weight_bytes) + weight_bytes) * n  # the gradient and staging copies
    state = int((2 if exact_skip else 1) * (4 * n + moments) + copies) // shards if states_on_host else 0
    compute = CUDA_RUNTIME_BYTES if on_gpu else estimate(cfg, micro_batch, seq, policy, dtype_bytes=4).total
    detail = (f"masters, moments and offload copies {state / GIB:.2f} + "
              + ("CUDA libraries" if on_gpu else "weights, gradient sums and activations")
              + f" {compute / GIB:.2f} + process {base_rss / GIB:.2f} GiB")
    return HostPlan(state + compute + base_rss, detail)
