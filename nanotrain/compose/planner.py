"""The layout planner: every feasible (tp, pp, dp, micro-batch, schedule, recompute, ZeRO stage), its
predicted step time and memory per GPU (``nanotrain.plan`` searches them beside the other engines' plans).

A model, not a measurement; each term is stated so it can be checked against one:

* compute: each stage's forward FLOPs (``LayeredModel.from_spec``'s per-layer costs, which also place the
  stage cuts exactly as the engine does) over ``tp``, at ``Hardware.flops`` per second; backward
  twice the forward, plus one forward with recompute. ZB-H1's I and W are a forward each.
* tensor parallel: two collectives per block per micro-batch in forward, two in backward (again
  in recompute), each a ring all-reduce (or with sequence parallelism the all-gather plus
  reduce-scatter moving the same bytes) of the micro-batch's ``[tokens, C]`` at ``tp_bandwidth``.
* pipeline: each stage output and its gradient sent at ``link_bandwidth``, charged to the action
  that sends it; the bubble is what ``pipeline.timeline`` gives for those per-action times.
* data parallel: a ring all-reduce of each stage's fp32 gradients at ``link_bandwidth``, started
  when the timeline ends that stage's last backward on its rank (the engine hands the stage's unit
  over there and the pipeline's cool-down goes on), one after the other on the rank's link. Only
  what runs past the end of the pipeline's timeline is counted: ``dp_s`` is the exposed part (the
  rank that finishes last, usually the first, exposes its own stage's reduction at least). ZeRO-1
  sums the same way; ZeRO-2 reduce-scatters instead (half the bytes, hidden the same way); both then
  all-gather the rank's new weights (in the compute dtype) before the next step's forward: the
  engine waits for that, so it is counted whole.
* memory per parameter a rank holds (its stages' leaves, ``held`` over tp), with ``w`` the compute
  dtype's bytes (4 fp32, 2 bf16) and ``m`` the two moments' (8 at 32 bits; 2 + 8 / block at 8 bits,
  counting every leaf as 8-bit where the engine keeps leaves under ``min_8bit_numel`` at 32, a
  fraction of a percent of GPT-2's parameters), as ``data_parallel.DataParallelAdam`` holds them:
  DDP 4 + w + 4 + m (the fp32 gradient buckets, the device weights, the fp32 masters and the
  moments); ZeRO-1 4 + w + (w + 4 + m) / dp (the whole gradient buckets and flat weights; of the
  shard, the optimizer's device weights, which are the all-gather's input, masters and moments), ZeRO-2
  4 / dp more (the reduce-scatter's output); ``offload`` leaves the masters and moments (4 + m) in
  host memory. Then the activations of the micro-batches a rank holds at once (found by
  walking its action list), per token and block (``block_values``) the residual stream's 4C values
  (each sublayer's input and normalised input; 2C + 2C/tp with sequence parallelism) and the
  sharded matmuls' S/tp (each column-parallel weight's output, each row-parallel weight's input:
  12C for GPT-2; attention's T x T scores not kept, as with flash attention), or C (C/tp) with
  recompute, plus ``reserve``; on the rank with the head, the loss's chunk of logits and gradients (``head_bytes``).

``Training`` (the compute dtype, the moments' bits, offload) is taken as the user's flags give
it: each changes the numerics or the host's work, which a step-time model should not trade away.
The ZeRO stage is a layout choice (``Layout.zero``, with dp > 1): it computes DDP's update. Its
all-gather comes after the pipeline where DDP's sums hide under the cool-down, so with several
stages per pipeline the pick is DDP unless only ZeRO fits; with one stage nothing hides, ZeRO-2's
reduce-scatter and all-gather move less than DDP's fp32 all-reduce, and it is picked.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

from nanotrain.core.footprint import MOMENT_BLOCK, divisors, head_loss_bytes, moments_per_param
from nanotrain.core.machine import GIB
from nanotrain.core.models import model_spec
from nanotrain.core.models.spec import VOCAB, Leaf, ModelSpec
from nanotrain.pipeline.layered import LayeredModel, StageSpec, partition
from nanotrain.pipeline.schedule import Action, Schedule, build_schedule
from nanotrain.pipeline.timeline import UNIT_COSTS, Slot, timeline
from nanotrain.tensor_parallel.shard import padded_vocab

BYTES = 4  # fp32 (``Training.compute_bytes``' default)


@dataclass(frozen=True)
class Hardware:
    n_gpus: int
    mem_bytes: float       # per GPU
    flops: float           # sustained FLOP/s of one GPU on the model's matmuls (a stated rate)
    tp_bandwidth: float    # bytes/s one GPU moves in a TP collective (NVLink inside a node)
    link_bandwidth: float  # bytes/s for pipeline sends and data-parallel all-reduces
    gpus_per_node: int = 8  # a TP group stays inside one node
    reserve_bytes: float = 1.0 * GIB  # CUDA context, allocator slack, buffers
    layer_overhead_s: float = 0.0  # fixed time per layer per action (kernel launches): favours larger micro-batches


@dataclass(frozen=True)
class Training:
    """How every rank trains, as the run's flags set it (given, not chosen: see the module doc)."""
    compute_bytes: int = BYTES  # weights, gradients and activations: 4 fp32, 2 bf16 (with fp32 masters)
    moment_bits: int = 32       # AdamW's two moments: 32, or 8 (block-wise quantized)
    offload: bool = False       # masters and moments in host memory
    block: int = MOMENT_BLOCK   # 8-bit moments: elements per block, each with an fp32 absmax per moment

    def param_bytes(self, zero: int, dp: int) -> float:
        """GPU bytes per parameter held: weights, gradients, optimizer state (the module doc's terms)."""
        w = self.compute_bytes
        optim = 0.0 if self.offload else 4 + moments_per_param(self.moment_bits, self.block)
        return 4 + w + optim if not zero else 4 + w + (w + optim + (4 if zero == 2 else 0)) / dp


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    n_micro: int  # per replica and step
    schedule: str
    recompute: bool
    zero: int = 0  # 1: the optimizer state sharded over dp (ZeRO-1); 2: the gradients reduce-scattered too

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    step_s: float
    compute_s: float  # the busiest rank's compute
    comm_s: float     # the busiest rank's TP collectives and pipeline sends
    dp_s: float       # the data-parallel traffic's exposed part: what runs past the pipeline's end
    bubble: float     # idle share of the pipeline's makespan
    mem_bytes: float
    fits: bool


def ring_all_reduce_s(n_bytes: float, ranks: int, bandwidth: float) -> float:
    """A bandwidth-bound ring all-reduce: each rank sends and receives 2 (n-1)/n of the buffer."""
    return 0.0 if ranks == 1 else 2 * (ranks - 1) / ranks * n_bytes / bandwidth


def held(leaf: Leaf, tp: int) -> float:
    """Elements of ``leaf`` one tensor-parallel rank holds: all when replicated, else 1/tp of them, a vocabulary
    padded first (``tensor_parallel.shard``)."""
    n, place = math.prod(leaf.shape), leaf.placement
    if place.replicated:
        return n
    if any(axis == VOCAB for axis, _ in place.segments):
        rows = leaf.shape[place.dim]
        n = n // rows * padded_vocab(rows, tp)
    return n / tp


@cache
def _held_by_path(cfg: Any, tp: int) -> dict[str, float]:
    return {leaf.path: held(leaf, tp) for leaf in model_spec(cfg).leaves}


def stage_params(cfg: Any, spec: StageSpec, tp: int) -> float:
    """Parameters one rank holds for ``spec``: each leaf its layers read (a tied embedding once) as ``held``."""
    layers = [*spec.layers, *(one for one in (spec.first, spec.head) if one is not None)]
    held_by = _held_by_path(cfg, tp)
    return sum(held_by[path] for path in dict.fromkeys(p for layer in layers for p in layer.paths))


def block_values(model: ModelSpec) -> tuple[int, int]:
    """Values per token a block keeps for its backward without recompute (the module docstring's terms): (the
    residual stream's, the sharded matmuls', which tensor parallelism splits)."""
    sharded = 0
    for path in model.block_units[0].paths:
        leaf = model.leaf(path)
        if len(leaf.shape) == 2 and not leaf.placement.replicated:
            sharded += leaf.shape[leaf.placement.dim]  # dim 0: a column-parallel output, 1: a row-parallel input
    return 4 * model.costs.width, sharded


def activation_bytes(cfg: Any, spec: StageSpec, tokens: int, tp: int, recompute: bool,
                     dtype_bytes: int = BYTES) -> float:
    """What one micro-batch of ``tokens`` keeps on this stage until its backward."""
    model = model_spec(cfg)
    c, sp, unit_of = model.costs.width, tp > 1, model.unit_of()
    blocks = len({unit_of[p] for layer in spec.layers for p in layer.paths})
    if recompute:
        per_token = c / tp if sp else c
    else:
        stream, sharded = block_values(model)
        # sequence parallelism shards the sublayers' inputs over tokens; their normalised inputs are gathered
        per_token = (stream / 2 + (stream / 2 + sharded) / tp) if sp else (stream + sharded / tp)
    return blocks * per_token * tokens * dtype_bytes


def head_bytes(cfg: Any, tokens: int, tp: int, dtype_bytes: int = BYTES) -> int:
    """The loss's memory on the stage with the head: ``core.footprint.head_loss_bytes`` over this rank's rows of
    the padded vocabulary (``tensor_parallel.vocab_parallel``)."""
    costs = model_spec(cfg).costs
    return head_loss_bytes(padded_vocab(costs.vocab, tp) // tp, costs.width, tokens, dtype_bytes)


def peak_in_flight(schedule: Schedule, rank: int, held: dict[int, float]) -> float:
    """Most bytes rank ``rank`` holds at once: a micro-batch's stage activations live from F to B (or I)."""
    now = peak = 0.0
    for a in schedule.ranks[rank]:
        if a.kind == "F":
            now += held[a.stage]
        elif a.kind in "BI":
            now -= held[a.stage]
        peak = max(peak, now)
    return peak


def _action_s(a: Action, fwd_s: list[float], tp_s: list[float], send_s: list[float], recompute: bool,
              n_stages: int) -> float:
    """One action's time: ``fwd_s`` per stage is a forward's compute (with the fixed per-layer overhead)."""
    redo = recompute and a.kind in "BI"
    compute = UNIT_COSTS[a.kind] * fwd_s[a.stage] + (fwd_s[a.stage] if redo else 0.0)
    comm = 0.0 if a.kind == "W" else tp_s[a.stage] * (2 if redo else 1)
    sends = a.stage < n_stages - 1 if a.kind == "F" else a.stage > 0 and a.kind != "W"
    return compute + comm + (send_s[a.stage] if sends else 0.0)


def exposed_dp_s(slots: list[list[Slot]], params: list[float], dp: int, bandwidth: float, zero: int = 0,
                 weight_bytes: int = BYTES) -> float:
    """How long the data-parallel traffic (the module docstring's term) runs past the pipeline's end, with
    ``params`` per stage, and under ZeRO the new weights gathered at ``weight_bytes`` per parameter."""
    end, late = max(s.end for rank in slots for s in rank), 0.0
    share = 0.5 if zero == 2 else 1.0  # a ring reduce-scatter (or all-gather) moves half an all-reduce's bytes
    for rank in slots:
        done = {s.action.stage: s.end for s in rank if s.action.kind in "BIW"}
        t = 0.0
        for stage in sorted(done, key=done.get):
            t = max(t, done[stage]) + share * ring_all_reduce_s(params[stage] * 4, dp, bandwidth)
        gather = sum(ring_all_reduce_s(params[s] * weight_bytes, dp, bandwidth) / 2 for s in done) if zero else 0.0
        late = max(late, max(t - end, 0.0) + gather)
    return late


@cache  # every layout of the same pipeline depth cuts the model alike: the search weighs thousands
def _stages(cfg: Any, seq: int, n_stages: int) -> tuple[StageSpec, ...]:
    return tuple(partition(LayeredModel.from_spec(cfg, seq), n_stages))


def predict(cfg: Any, seq: int, layout: Layout, hw: Hardware, training: Training = Training()) -> Prediction:
    """Step time and peak memory per GPU of ``layout`` on ``hw`` (see the module docstring)."""
    t, p, b, w = layout.tp, layout.pp, layout.micro_batch, training.compute_bytes
    virtual = 2 if layout.schedule == "interleaved-1f1b" else 1
    schedule = build_schedule(layout.schedule, p, layout.n_micro, virtual)
    specs = _stages(cfg, seq, schedule.n_stages)
    tokens, width = b * seq, model_spec(cfg).costs.width
    boundary = tokens * width * w / (t if layout.sequence_parallel else 1)
    fwd_s, tp_s, send_s = [], [], []
    for spec in specs:
        flops = tokens * spec.cost / t
        ends = (spec.first is not None) + (spec.head is not None)
        fwd_s.append(flops / hw.flops + hw.layer_overhead_s * (len(spec.layers) + ends))
        collectives = 2 * len(spec.layers) + ends
        tp_s.append(collectives * ring_all_reduce_s(tokens * width * w, t, hw.tp_bandwidth))
        send_s.append(boundary / hw.link_bandwidth)
    cost = partial(_action_s, fwd_s=fwd_s, tp_s=tp_s, send_s=send_s, recompute=layout.recompute, n_stages=len(specs))
    slots = timeline(schedule, cost)
    pipe_s = max(s.end for rank in slots for s in rank)
    busy = [sum(cost(a) for a in acts) for acts in schedule.ranks]
    zeros = [0.0] * len(specs)
    compute = [sum(_action_s(a, fwd_s, zeros, zeros, layout.recompute, len(specs)) for a in acts)
               for acts in schedule.ranks]
    params = [sum(stage_params(cfg, specs[s], t) for s in schedule.stages_of(r)) for r in range(p)]
    dp_s = exposed_dp_s(slots, [stage_params(cfg, spec, t) for spec in specs], layout.dp, hw.link_bandwidth,
                        layout.zero, w)
    held = {s.index: activation_bytes(cfg, s, tokens, t, layout.recompute, w) for s in specs}
    per_param = training.param_bytes(layout.zero, layout.dp)
    head = [head_bytes(cfg, tokens, t, w) if any(specs[s].head for s in schedule.stages_of(r)) else 0.0
            for r in range(p)]
    mem = max(per_param * params[r] + peak_in_flight(schedule, r, held) + head[r] for r in range(p)) + hw.reserve_bytes
    return Prediction(layout, pipe_s + dp_s, max(compute), max(b - c for b, c in zip(busy, compute)), dp_s,
                      1 - sum(busy) / (pipe_s * p), mem, mem <= hw.mem_bytes)


def layouts(cfg: Any, hw: Hardware, global_batch: int, max_micro_batch: int = 16) -> list[Layout]:
    """Every layout the engine can run: tp within a node and at most the key/value heads, pp at most the
    blocks, micro-batches dividing each replica's share, interleaving where its counts allow, ZeRO-1 and -2 where
    dp > 1."""
    n, out, model = hw.n_gpus, [], model_spec(cfg)
    heads = min(model.heads[:2])  # query heads, and the key/value heads they share
    for tp in divisors(n, min(heads, hw.gpus_per_node)):
        for pp in divisors(n // tp, model.n_layer):
            dp = n // (tp * pp)
            if global_batch % dp:
                continue
            share = global_batch // dp
            for b in divisors(share, max_micro_batch):
                m = share // b
                names = ["1f1b"] if pp == 1 else ["gpipe", "1f1b", "zb-h1"]
                if pp > 1 and m % pp == 0 and model.n_layer >= 2 * pp:
                    names.append("interleaved-1f1b")
                out += [Layout(tp, pp, dp, b, m, s, r, z) for s in names for r in (False, True)
                        for z in ((0, 1, 2) if dp > 1 else (0,))]
    return out


def plan(cfg: Any, seq: int, hw: Hardware, global_batch: int,
         training: Training = Training()) -> list[Prediction]:
    """Every layout's prediction, fastest first; the pick is the first that fits."""
    preds = [predict(cfg, seq, lay, hw, training) for lay in layouts(cfg, hw, global_batch)]
    if not preds:
        raise ValueError(f"no layout of {hw.n_gpus} GPUs runs a global batch of {global_batch} sequences; "
                         f"use a batch divisible by some data-parallel size")
    # Equal times (the FLOP model is linear in tokens): fewer, larger micro-batches, then less memory.
    return sorted(preds, key=lambda q: (not q.fits, round(q.step_s, 9), q.layout.n_micro, q.mem_bytes))
