"""The fastest weight-streaming plan within the caps, by a step-time model, and the smallest caps any plan meets.

``stream_plan.estimate`` says what one plan holds; this module tries every micro-batch, tail, tail pass,
placement of the embedding and head (in their slots, or staged) and number of block inputs in host memory,
keeps the plans that fit both caps and ranks them by a step-time model, so ``tasks.finetune --stream``
needs no hand-given ``--tail``. The model, per step of ``batch`` sequences (``nanotrain.stream.trainer``'s
order of work), each phase the longer of its compute and of what the host link carries meanwhile (each
direction on its own: uploads and downloads overlap):

* forward of the layer-major blocks: their FLOPs at ``flops``; the link brings every block's fp32
  masters (the tail's too, kept for the step) and takes the block inputs kept in host memory;
* the tail and the LM head, pass by pass: compute only (their weights are on the device);
* backward of the layer-major blocks: their backward and the recompute (the block's forward short of its
  last matmul); the link brings each block's masters and moments (the top block's masters are still
  there), the tail's, a staged head's and the host block inputs, and takes the updated ones back;
* a staged embedding's update after the last block: its masters and moments both ways, exposed;
* a deferred step (clipping, fp16): the blocks' gradients come back and masters and moments go again;
* a fixed ``pass_overhead_s`` per block, pass and action (forward, recompute, backward; a tail block
  has no recompute): the launches and waits that make small passes slow.

``StreamCosts``' defaults were measured on H200 machines (docs/BENCHMARKS.md, 2026-11-23): the rate and
the per-pass cost fitted to two single-GPU gpt2-xl steps of ``tasks.train3d`` (now ``tasks.finetune --tp
--pp``; micro-batches of 4 and of 1), the link by ``measure_link`` (54.8 GB/s). A model to rank plans by,
not a promise: on gpt2-large under
11 GiB it predicted 79.3 seq/s for its pick, which ran at 76.8; a GPT-2-shaped 6.6B model under 24 GiB,
10.0 seq/s for 10.0-10.6 measured. ``GPUS`` scales it to other cards by their datasheet peaks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from nanotrain.core.flops import PEAK_BF16_FLOPS
from nanotrain.core.footprint import cap_for, divisors
from nanotrain.core.lora_footprint import Stored
from nanotrain.core.machine import GIB
from nanotrain.core.models.spec import ModelSpec
from nanotrain.stream.footprint import StreamChoice, StreamJob, StreamPlan, estimate


MAX_MICRO_BATCH = 16  # the largest micro-batch the search tries


@dataclass(frozen=True)
class StreamCosts:
    flops: float = 500e12            # sustained rate of a compiled block's matmuls and attention (bf16)
    pass_overhead_s: float = 0.15e-3  # per block, per pass, per action
    link_bytes_s: float = 50e9       # host to device, pinned memory (each direction)


@dataclass(frozen=True)
class GPU:
    """A card as the plan assumes it: datasheet numbers, not measurements of this machine."""
    name: str
    memory_gib: float     # what the allocator may use: the card's memory less ~0.5 GiB of CUDA context
    link_bytes_s: float   # pinned host-to-device copies over its PCIe generation, x16
    peer_bytes_s: float   # what one GPU moves in a ring collective with its peers (NVLink, else PCIe): assumed,
                          # as the 3D planner's --tp-gbps default

    @property
    def peak_flops(self) -> float:
        return PEAK_BF16_FLOPS[self.name]

    def costs(self) -> StreamCosts:
        """``StreamCosts`` at the fraction of the peak the H200 fit sustained (500 of 989 TFLOP/s)."""
        return StreamCosts(flops=self.peak_flops * 500 / 989, link_bytes_s=self.link_bytes_s)


GPUS = {g.name: g for g in (
    GPU("H100", 79.1 - 0.5, 55e9, 100e9), GPU("H200", 139.8 - 0.5, 55e9, 100e9), GPU("A100", 79.1 - 0.5, 25e9, 100e9),
    GPU("4090", 23.6 - 0.5, 25e9, 25e9), GPU("3090", 23.6 - 0.5, 24e9, 24e9))}


@dataclass(frozen=True)
class RankedPlan:
    plan: StreamPlan
    step_s: float
    forward_s: float
    top_s: float       # the tail and the LM head
    backward_s: float
    end_s: float       # after the backward: a staged embedding's update, a deferred step's updates
    link_bound: bool   # the backward waits for the link rather than for compute


def predict(plan: StreamPlan, costs: StreamCosts) -> RankedPlan:
    """The model's step time for one plan (see the module docstring)."""
    job, c = plan.job, plan.choice
    spec = job.spec
    table, block_unit = spec.costs, spec.block_units[0]
    n, tokens, block, link = table.n_layer - c.tail, job.batch * job.seq, table.block_params, costs.link_bytes_s
    fwd, redo, head = table.block_forward_flops(job.seq), table.block_recompute_flops(job.seq), table.head_flops()
    state, host_inputs = job.state(block_unit), c.on_host * job.boundary  # a block's masters and moments
    passes, tail_passes = job.batch // c.micro_batch, job.batch // (c.tail_micro_batch or c.micro_batch)
    forward = max(tokens * n * fwd / costs.flops + n * passes * costs.pass_overhead_s,
                  (n + c.tail) * block * 4 / link, host_inputs / link)
    top = tokens * (3 * c.tail * fwd + 3 * head) / costs.flops + 2 * c.tail * tail_passes * costs.pass_overhead_s
    compute = tokens * n * (2 * fwd + redo) / costs.flops + 2 * n * passes * costs.pass_overhead_s
    head_state = job.state(spec.head_unit) if c.staged_ends else 0
    end = (job.state(spec.embed_unit) if c.staged_ends else 0) / link
    if job.deferred:  # the blocks' gradients go down; after it, back up beside their masters and moments
        up, down = host_inputs, n * block * 4
        end += max((n + c.tail) * state + n * block * 4 + head_state, (n + c.tail) * state + head_state) / link
    else:
        down = (n + c.tail) * state + head_state
        up = down - (block * 4 if n else 0) + host_inputs
    carried = max(up, down) / link
    backward = max(compute, carried)
    step = forward + top + backward + end
    return RankedPlan(plan, step, forward, top, backward, end, carried > compute)


def predict_frozen(plan: StreamPlan, costs: StreamCosts, spec: ModelSpec, kept: Stored) -> RankedPlan:
    """The step of ``spec``, a model whose base is frozen under adapters (``models.lora``), streamed by ``plan``
    (its base model's choice): the phases of ``predict``, less what a frozen base does not do. A frozen matrix's
    backward is its input gradient alone (2 FLOPs a weight a token, not 4: ``Costs.frozen_matmul``), the head's
    too; the link brings each block as stored (``kept.block``: NF4 or the compute dtype) for its forward and again
    for its recompute, and nothing of the base's masters and moments moves (the pairs stay on the device).
    Measured: llama-3.1-70b QLoRA under 24 GiB ran 14.10 s a step where this gives 13.0 (one H200, 2026-11-28 sixth);
    timed as the base model's training (``predict``), it was 20.06. A 4-bit base's dequantising is not counted."""
    job, c = plan.job, plan.choice
    table = spec.costs
    n, tokens, link = table.n_layer - c.tail, job.batch * job.seq, costs.link_bytes_s
    fwd, redo, head = table.block_forward_flops(job.seq), table.block_recompute_flops(job.seq), table.head_flops()
    block_bytes = kept.block
    backward_flops = 2 * fwd - 2.0 * (table.block_params - kept.pair_params)  # the pairs' weight gradients stay
    passes, tail_passes = job.batch // c.micro_batch, job.batch // (c.tail_micro_batch or c.micro_batch)
    forward = max(tokens * n * fwd / costs.flops + n * passes * costs.pass_overhead_s,
                  (n + c.tail) * block_bytes / link, c.on_host * job.boundary / link)
    top = (tokens * (c.tail * (fwd + backward_flops) + 2 * head) / costs.flops
           + 2 * c.tail * tail_passes * costs.pass_overhead_s)
    compute = tokens * n * (backward_flops + redo) / costs.flops + 2 * n * passes * costs.pass_overhead_s
    # a tail block's update fetches its pairs' masters and moments into the tail slot, and its base with them
    # where the slot last held another block (``StreamedAdam.fetch``): all but the top one's
    carried = max((n + max(c.tail - 1, 0)) * block_bytes, c.on_host * job.boundary) / link
    backward = max(compute, carried)
    return RankedPlan(plan, forward + top + backward, forward, top, backward, 0.0, carried > compute)


def choices(job: StreamJob, micro_batch: int | None = None, tail: int | None = None, tail_mb: int | None = None,
            staged: bool | None = None) -> Iterator[StreamChoice]:
    """Every (micro-batch, tail, tail micro-batch, staged ends) a plan may take, given ones kept; host inputs
    are left to the caller (0 here)."""
    n = job.spec.n_layer
    for mb in [micro_batch] if micro_batch else divisors(job.batch, MAX_MICRO_BATCH):
        for t in [tail] if tail is not None else range(n + 1):
            for tm in [tail_mb] if tail_mb or not t else divisors(mb):
                if tm and mb % tm:
                    continue
                for st in [staged] if staged is not None else ([False, True] if job.shards == 1 else [False]):
                    yield StreamChoice(mb, 0, t, tm, st)


def by_host_inputs(job: StreamJob, choice: StreamChoice) -> Iterator[StreamPlan]:
    """The plans of ``choice`` with 0, 1, ... of its layer-major blocks' inputs in host memory."""
    for on_host in range(job.spec.n_layer - choice.tail + 1):
        yield estimate(job, replace(choice, on_host=on_host))


def search_streaming(job: StreamJob, gpu_cap: int, host_cap: int | None, costs: StreamCosts = StreamCosts(),
                     micro_batch: int | None = None, tail: int | None = None, tail_mb: int | None = None,
                     staged: bool | None = None) -> list[RankedPlan]:
    """Every plan that fits both caps (for each choice, the fewest block inputs in host memory that fit the
    GPU), fastest first; a given ``micro_batch``, ``tail``, ``tail_mb`` or ``staged`` is kept. Raises
    MemoryError (``refusal``: the smallest caps that work) when none fits."""
    ranked = []
    for choice in choices(job, micro_batch, tail, tail_mb, staged):
        plan = next((p for p in by_host_inputs(job, choice) if p.fits(gpu_cap, None)), None)
        if plan is not None and plan.fits(gpu_cap, host_cap):
            ranked.append(predict(plan, costs))
    if not ranked:
        raise MemoryError(refusal(job, gpu_cap, host_cap, micro_batch, tail, tail_mb, staged))
    # Equal predictions: the larger micro-batch, then fewer block inputs in host memory.
    return sorted(ranked, key=lambda r: (round(r.step_s, 6), -r.plan.micro_batch, r.plan.on_host))


def smallest_caps(job: StreamJob, gpu_cap: int, host_cap: int | None, *fixed) -> tuple[int | None, int | None]:
    """(the smallest GPU cap any plan meets within ``host_cap``, the smallest host cap any plan meets within
    ``gpu_cap``); None where no plan does. ``fixed``: ``search_streaming``'s micro_batch, tail, tail_mb, staged."""
    least_gpu = least_host = None
    for choice in choices(job, *fixed):
        for plan in by_host_inputs(job, choice):
            if host_cap is None or plan.host_bytes <= host_cap:
                need = cap_for(plan.device_bytes, job.expandable, job.shards)
                least_gpu = need if least_gpu is None else min(least_gpu, need)
            if plan.fits(gpu_cap, None):
                least_host = plan.host_bytes if least_host is None else min(least_host, plan.host_bytes)
                break  # more host inputs only add host memory
    return least_gpu, least_host


def refusal(job: StreamJob, gpu_cap: int, host_cap: int | None, *fixed) -> str:
    """One line: no plan fits, and the smallest caps that would."""
    least_gpu, least_host = smallest_caps(job, gpu_cap, host_cap, *fixed)
    host = "no host cap" if host_cap is None else f"a {host_cap / GIB:.1f} GiB host cap"
    options = []
    if least_gpu is not None:
        options.append(f"--gpu-mem-gib {least_gpu / GIB:.1f}" + ("" if host_cap is None else " with this host cap"))
    if least_host is not None:
        options.append(f"--host-mem-gib {least_host / GIB:.1f} with this GPU cap")
    if not options:  # both must rise: the smallest GPU cap of all, and the host that plan needs
        gpu, _ = smallest_caps(job, gpu_cap, None, *fixed)
        if gpu is not None:
            host_at = smallest_caps(job, gpu, None, *fixed)[1]
            options.append(f"--gpu-mem-gib {gpu / GIB:.1f} with --host-mem-gib {host_at / GIB:.1f}")
    fix = " or ".join(options) if options else "a shorter --seq or a smaller --batch (no cap fits these)"
    bits = " (or --adam-bits 8)" if job.state_bits == 32 else ""
    return (f"no streaming plan fits a {gpu_cap / GIB:.1f} GiB GPU cap and {host} at batch {job.batch} x "
            f"{job.seq}: the smallest caps that work are {fix}{bits}")


def measure_link(device: torch.device, mib: int = 256, repeats: int = 3) -> float:
    """Bytes per second of a pinned host-to-device copy on this machine (the best of ``repeats``); the pinned
    buffer is handed back to the system after (a cached one would sit in the run's host memory)."""
    host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    dev.copy_(host, non_blocking=True)  # the first copy pays for setup
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    nbytes = host.numel()
    del host, dev
    torch.cuda.empty_cache()
    empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)  # torch 2.9 and later
    if empty_host_cache is not None:
        empty_host_cache()
    return nbytes / best
