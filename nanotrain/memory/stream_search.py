"""The fastest weight-streaming plan within the caps: micro-batch, tail, the tail's passes, host boundaries.

``plan.plan_streaming`` answers "does this fit, and with how many block inputs in host memory"; this
module asks it for every (micro-batch, tail, tail micro-batch) and ranks the plans that fit by a
step-time model, so ``tasks.finetune --stream`` needs no hand-given ``--tail``. The model, per step
of ``batch`` sequences (``nanotrain.train.streamed``'s order of work):

* forward of the layer-major blocks: their FLOPs at ``flops``, or the copy of their weights over the
  host link, whichever is longer;
* the tail and the LM head, micro-batch by micro-batch: compute only (their weights stay resident);
* backward of the layer-major blocks: their backward and the recompute (the block's forward short of
  its last matmul), or what the link carries meanwhile, whichever is longer: each block's
  weights again, the masters and moments of every unit (the tail's updates ride along here), and
  the block inputs kept in host memory;
* a fixed ``pass_overhead_s`` per block, pass and action (forward, recompute, backward; a tail block
  has no recompute): the launches and waits that make small passes slow.

``StreamCosts``' defaults were measured on H200 machines (docs/BENCHMARKS.md, 2026-11-23): the rate and
the per-pass cost fitted to two single-GPU gpt2-xl steps of ``tasks.train3d`` (micro-batches of 4 and
of 1), the link by ``measure_link`` (54.8 GB/s; ``tasks.finetune`` measures its own machine's before
planning). The FLOPs and bytes are the model's cost table (``ModelSpec.costs``). A model to rank plans
by, not a promise: on gpt2-large under 11 GiB it predicted 79.3 seq/s for its pick, which ran at 76.8,
and 76.9 for the hand-tuned tail of 16 in passes of 4 (63.7 in the same call, 71.0-75.8 in earlier
runs); counting the biases' FLOPs since adds 0.07% to these predictions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from nanotrain.models import model_spec
from nanotrain.memory.plan import StreamPlan, micro_batches, plan_streaming


@dataclass(frozen=True)
class StreamCosts:
    flops: float = 500e12            # sustained rate of a compiled block's matmuls and attention (bf16)
    pass_overhead_s: float = 0.15e-3  # per block, per pass, per action
    link_bytes_s: float = 50e9       # host to device, pinned memory


@dataclass(frozen=True)
class RankedPlan:
    plan: StreamPlan
    tail: int
    tail_micro_batch: int | None
    step_s: float
    forward_s: float
    backward_s: float
    link_bound: bool  # the backward waits for the link rather than for compute


def predict(cfg: Any, batch: int, seq: int, plan: StreamPlan, tail: int, tail_mb: int | None,
            state_bits: int, costs: StreamCosts, dtype_bytes: int = 2, shards: int = 1) -> RankedPlan:
    """The model's step time for one plan (see the module docstring)."""
    table = model_spec(cfg).costs  # the model's, beside the machine's ``costs``
    c, n, tokens, block = table.width, table.n_layer - tail, batch * seq, table.block_params
    # FLOPs per token: a block's forward (causal attention), its recompute (all but the last matmul), the LM head
    fwd, redo, head = table.block_forward_flops(seq), table.block_recompute_flops(seq), table.head_flops()
    state = (4 + (8 if state_bits == 32 else 2 + 8 / 2048)) / shards  # masters and moments, bytes a parameter
    passes, tail_passes = batch // plan.micro_batch, batch // (tail_mb or plan.micro_batch)
    forward = max(tokens * n * fwd / costs.flops + n * passes * costs.pass_overhead_s,
                  n * block * dtype_bytes / costs.link_bytes_s)
    top = tokens * (3 * tail * fwd + 3 * head) / costs.flops + 2 * tail * tail_passes * costs.pass_overhead_s
    compute = tokens * n * (2 * fwd + redo) / costs.flops + 2 * n * passes * costs.pass_overhead_s
    carried = (n * block * dtype_bytes + table.total_params * state
               + plan.on_host * batch * seq * c * dtype_bytes) / costs.link_bytes_s
    backward = max(compute, carried)
    return RankedPlan(plan, tail, tail_mb, forward + top + backward, forward, backward, carried > compute)


def search_streaming(cfg: Any, batch: int, seq: int, gpu_cap: int, host_cap: int | None, state_bits: int,
                     costs: StreamCosts = StreamCosts(), dtype_bytes: int = 2, micro_batch: int | None = None,
                     tail: int | None = None, tail_mb: int | None = None, base_rss: int = 0,
                     max_micro_batch: int = 16, shards: int = 1, deferred: bool = False) -> list[RankedPlan]:
    """Every plan that fits both caps, fastest first; a given ``micro_batch``, ``tail`` or ``tail_mb`` is
    kept. Raises ``plan_streaming``'s MemoryError (naming the closest plan) when none fits."""
    ranked, error = [], None
    for mb in [micro_batch] if micro_batch else micro_batches(batch, max_micro_batch):
        for t in [tail] if tail is not None else range(model_spec(cfg).n_layer + 1):
            for tm in [tail_mb] if tail_mb or not t else micro_batches(mb):
                if tm and mb % tm:
                    continue
                try:
                    plan = plan_streaming(cfg, batch, seq, gpu_cap, host_cap, state_bits, dtype_bytes, mb, base_rss,
                                          tail=t, tail_mb=tm, shards=shards, deferred=deferred)
                except MemoryError as e:
                    error = error or e
                    continue
                ranked.append(predict(cfg, batch, seq, plan, t, tm, state_bits, costs, dtype_bytes, shards))
    if not ranked:
        raise error
    # Equal predictions: the larger micro-batch, then fewer block inputs in host memory.
    return sorted(ranked, key=lambda r: (round(r.step_s, 6), -r.plan.micro_batch, r.plan.on_host))


def format_ranked(ranked: list[RankedPlan], batch: int, rows: int = 8) -> str:
    """The fastest ``rows`` plans as a table, the first being the pick."""
    lines = [f"{'mb':>3} {'tail':>4} {'tail mb':>7} {'on host':>7} {'device GiB':>10} {'host GiB':>8} "
             f"{'fwd s':>6} {'bwd s':>6} {'step s':>6} {'seq/s':>6}  backward bound by"]
    for r in ranked[:rows]:
        p = r.plan
        lines.append(f"{p.micro_batch:>3} {r.tail:>4} {r.tail_micro_batch or '-':>7} {p.on_host:>7} "
                     f"{p.device_bytes / 2**30:>10.2f} {p.host_bytes / 2**30:>8.2f} {r.forward_s:>6.3f} "
                     f"{r.backward_s:>6.3f} {r.step_s:>6.3f} {batch / r.step_s:>6.1f}  "
                     f"{'the host link' if r.link_bound else 'compute'}")
    return "\n".join(lines + [f"({len(ranked)} plans fit)"])


def measure_link(device: torch.device, mib: int = 256, repeats: int = 3) -> float:
    """Bytes per second of a pinned host-to-device copy on this machine (the best of ``repeats``)."""
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
    return host.numel() / best
