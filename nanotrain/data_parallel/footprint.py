"""Per-GPU memory and step time of a data-parallel run at each ZeRO stage (``nanotrain.plan`` searches them).

What ``nanotrain.data_parallel`` holds on each of N GPUs for a model of n parameters computed in a
dtype of d bytes (padding, under N elements per unit, left out):

| stage | weights                              | gradients (fp32)                  | masters + moments |
| ----- | ------------------------------------ | --------------------------------- | ----------------- |
| 0 DDP | n d                                  | 4 n (the buckets, summed in place)| (4 + m) n         |
| 1     | n d + n d / N (see below)            | 4 n                               | (4 + m) n / N     |
| 2     | n d + n d / N                        | 4 n + 4 n / N (the reduced shard) | (4 + m) n / N     |
| 3     | n d / N + the gathered units         | 4 n / N + the units being reduced | (4 + m) n / N     |
| 3 held| n d (the shard a slice of it)        | 4 n / N + the units being reduced | (4 + m) n / N     |

ZeRO-1, -2 and -3 keep the rank's shard once more in d: the weights its optimizer updates, which are the
all-gather's input (``ShardedAdam.new_shard``).
m is 8 bytes for 32-bit moments, about 2 for 8-bit ones (``spec.fp32_moments``, the embeddings, keep
32-bit); with exact skips (fp16) masters and moments are kept twice. They are on the GPU only with
``--states gpu``; with ``--states cpu`` each rank's host holds them. ZeRO-3 holds two segments' units
gathered at once (one being computed, the next prefetched: a block, or the head's units, which with a
tied head are the head and the embeddings) and, in fp32, the gradients of the head's units (the tied
embeddings' collected from the head's backward to the embeddings') and of two blocks, plus one unit's
gradient in d; without recompute only the head's (at the peak, the start of backward, no block's sum is made yet).
Held (``DPConfig.hold``), every unit stays gathered through the step, the rank's shard a slice of it. Activations
and the LM head are the single-GPU estimate's (``core.footprint.estimate``, compiled blocks' included) at the rank's
micro-batch; a bf16 reduction (``reduce_bytes=2``) adds its send buffers. Every
count comes from the model's spec (``ModelSpec.costs``, its units). The total is the allocated peak; a plan keeps
``core.footprint.margin`` of the cap free beside it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanotrain.core.footprint import estimate, moment_bytes, resident_step_s
from nanotrain.core.machine import GIB
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.core.models import model_spec
from nanotrain.data_parallel.config import stage_name


@dataclass(frozen=True)
class ZeroPlan:
    zero: int
    world: int
    micro_batch: int
    recompute: str
    weights: int
    gradients: int
    masters: int
    moments: int
    states_on_gpu: bool
    activations: int  # with the LM head's chunk
    total: int        # the allocated peak on each GPU
    hold: bool = False  # ZeRO-3's units held gathered through the step

    def describe(self) -> str:
        stage = stage_name(self.zero, self.hold)
        where = "" if self.states_on_gpu else " in host memory, not counted"
        return (f"{stage} over {self.world} GPUs, micro-batch {self.micro_batch}, recompute {self.recompute}: "
                f"weights {self.weights / GIB:.2f} + gradients {self.gradients / GIB:.2f} + activations "
                f"{self.activations / GIB:.2f} GiB (masters {self.masters / GIB:.2f} + moments "
                f"{self.moments / GIB:.2f} GiB{where}) = {self.total / GIB:.2f} GiB per GPU allocated at the peak")


def zero_estimate(cfg: Any, world: int, zero: int, micro_batch: int, seq: int, recompute: str,
                  dtype_bytes: int = 2, state_bits: int = 32, states_on_gpu: bool = False,
                  exact_skip: bool = False, reduce_bytes: int = 4, compiled: bool = False,
                  hold: bool = False) -> ZeroPlan:
    """The per-GPU bytes of one rank (see the module's table); ``compiled``: blocks compiled where ``recompute``
    is none; ``hold``: ZeRO-3's units held gathered through the step."""
    spec = model_spec(cfg)
    costs, d = spec.costs, dtype_bytes
    n, embed, block = costs.total_params, costs.embed_params, costs.block_params
    # The head's segment (``data_parallel.zero3``): the head unit, and the embeddings when the head is tied to them.
    head = costs.head_params + (embed if spec.head_weight not in spec.head_unit.paths else 0)
    shard = n // world if zero else n
    if zero == 3:
        weights = n * d if hold else shard * d + max(embed, block, head) * d + block * d
        # in flight at the peak: the head's sum; two blocks' too where backward recomputes (without recompute the
        # peak is the head's backward, every block's activations held: the blocks' sums come as theirs are freed)
        flight = max(embed, head) + (2 * block if recompute != "none" else 0)
        gradients = 4 * shard + 4 * flight + max(embed, block, costs.head_params) * d
    else:
        weights = n * d + (shard * d if zero else 0)  # the whole weights; the shard's, the gather's input
        gradients = 4 * n + (4 * shard if zero == 2 else 0)
        if reduce_bytes != 4:
            gradients += reduce_bytes * (n + (shard if zero == 2 else 0))
    copies = 2 if exact_skip else 1
    masters, moments = copies * 4 * shard, int(copies * moment_bytes(spec, shard, state_bits))
    act = estimate(cfg, micro_batch, seq, RecomputePolicy.parse(recompute), d, compiled=compiled)
    activations = act.activations + act.head
    on_gpu = weights + gradients + activations + (masters + moments if states_on_gpu else 0)
    return ZeroPlan(zero, world, micro_batch, recompute, weights, gradients, masters, moments, states_on_gpu,
                    activations, on_gpu, hold)


def zero_step_s(cfg: Any, world: int, zero: int, batch: int, seq: int, micro_batch: int, recompute: str,
                flops: float, pass_overhead_s: float, peer_bytes_s: float, dtype_bytes: int = 2, reduce_bytes: int = 4,
                states_on_gpu: bool = True, hold: bool = False) -> float:
    """One step of ``batch`` sequences over ``world`` ranks: each rank's resident step on its rows (its host's AdamW,
    with ``--states cpu``: every rank's share of the state, the host shared), the gradients' reduction beyond the
    backward it overlaps (a ring at ``peer_bytes_s`` per GPU; buckets fire as units finish), and what the stage
    adds after it: ZeRO-1/2 gather the updated weights; ZeRO-3 gathers every unit in forward and again in backward
    and reduce-scatters its gradient, each micro-batch, overlapped with the compute; held, it gathers each unit once a
    step, the first one's gathering exposed."""
    costs = model_spec(cfg).costs
    n = costs.total_params
    host = 0 if states_on_gpu else (n if zero else n * world)  # DDP: every rank updates the whole model
    policy = RecomputePolicy.parse(recompute)
    step = resident_step_s(cfg, batch // world, seq, micro_batch, policy, flops, pass_overhead_s, host)
    if world == 1:
        return step
    ring = (world - 1) / world
    reduce = n * reduce_bytes * ring * (1 if zero >= 2 else 2) / peer_bytes_s  # reduce-scatter, or all-reduce
    if zero == 3:  # a micro-batch's first gathering and last reduction have no compute to hide behind
        micro_batches = batch // world // micro_batch
        unit = max(costs.embed_params, costs.block_params, costs.head_params)
        gather, last = n * dtype_bytes * ring / peer_bytes_s, unit * reduce_bytes * ring / peer_bytes_s
        first = unit * dtype_bytes * ring / peer_bytes_s
        if hold:
            return max(step, micro_batches * reduce + gather) + micro_batches * last + first
        return max(step, micro_batches * (reduce + 2 * gather)) + micro_batches * (first + last)
    gather = n * dtype_bytes * ring / peer_bytes_s if zero else 0.0
    return step + max(0.0, reduce - 2 / 3 * step) + gather  # the backward is about 2/3 of the compute
