"""What each engine offers the search: every plan the pins leave open that fits the machine, with its bytes and
predicted step time, each stated by the engine next to it: the resident trainer (``core.footprint``: ``estimate``,
``resident_step_s``, ``plan_resident_host``), data parallelism (``data_parallel.footprint``: ``zero_estimate``,
``zero_step_s``), streaming (``stream.footprint`` and ``stream.search``), the composed 3D trainer
(``compose.planner.predict``). This module only enumerates what the pins leave open and keeps the plans under
both caps (``search.py`` ranks them), each engine's predicted allocated peak leaving ``core.footprint.margin`` of
the GPU cap free. A setting given (``Pins``) is never traded away. The 3D trainer's plans: ``plan.composed``.

An adapted spec (LoRA, ``core.models.lora``) is planned with the adapters' bytes (``core.lora_footprint``): resident
on one GPU or replicated (ZeRO-1/2: each rank holds the base and the pairs whole, the pairs' small state counted
unsharded), or streamed, the streamed plans' choices those of the base model's training (a tail where given), their
step a frozen base's (``stream.search.predict_frozen``), their bytes the adapters' (``_streamed_adapted``); no 3D
layout.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from nanotrain.core.footprint import (HostPlan, MemoryPlan, divisors, estimate, fits, leaf_moment_bytes,
                                      plan_resident_host, state_bytes)
from nanotrain.core.machine import CUDA_RUNTIME_BYTES, GIB
from nanotrain.core.leaves import rank_load_bytes
from nanotrain.core.lora_footprint import (adapter_state_bytes, lora_estimate, lora_load_bytes, stored,
                                           streamed_lora_bytes)
from nanotrain.core.models import model_spec
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.data_parallel.footprint import zero_estimate, zero_step_s
from nanotrain.plan.plan import Plan
from nanotrain.stream.footprint import StreamJob
from nanotrain.stream.search import StreamCosts, by_host_inputs, choices, predict_frozen, search_streaming

RESIDENT_POLICIES = ("none", "lean", "selective", "every")  # least recompute first


@dataclass(frozen=True)
class Pins:
    """The settings given (on the command line, in ``--config``, or by the checkpoint a run resumes); None:
    planned. ``stream`` True pins streaming; a run without ``--stream`` may still be planned streamed."""
    stream: bool = False
    states: str | None = None
    recompute: str | None = None
    micro_batch: int | None = None
    tail: int | None = None
    tail_micro_batch: int | None = None
    dp: int | None = None
    zero: int | None = None
    hold: bool | None = None  # ZeRO-3's weights held through the step
    tp: int | None = None
    pp: int | None = None
    schedule: str | None = None
    gpus: int | None = None  # how many GPUs the run takes (``--gpus``, the layout given); None: planned, 1 to the box's


@dataclass(frozen=True)
class Ask:
    """What is to be trained, in the numerics the flags chose (a plan never changes them)."""
    cfg: Any
    batch: int
    seq: int
    adam_bits: int = 32
    dtype_bytes: int = 2
    fp16: bool = False         # fp16 compute: gradients travel in fp32
    deferred: bool = False     # clipping or fp16: a streamed step waits for the whole gradient
    exact_skip: bool = False   # a second copy of masters and moments (``plan.run.exact_skip``)
    # --compile given: compiled blocks, which the resident trainer has only without recompute; None (compiled by
    # default, not given): the same, and ZeRO-3 recomputing every unit, eager
    compile: bool | None = False
    reduce_bytes: int = 4      # data-parallel gradients travel in fp32 (4) or bf16 (2)
    pins: Pins = field(default_factory=Pins)
    base_bits: int = 16        # an adapted spec's frozen base: in the compute dtype (16) or NF4 (4)

    @property
    def compiled(self) -> bool:
        """Whether blocks are compiled: given (True) or by default (None); the resident trainer compiles the blocks
        it does not recompute (``RecomputePolicy.block_fn``)."""
        return self.compile is not False

    @property
    def lora(self) -> bool:
        """Whether ``cfg`` is an adapted spec: a frozen base under trained pairs."""
        return model_spec(self.cfg).frozen


@dataclass(frozen=True)
class Box:
    """The machine at hand: ``gpus`` GPUs of ``gpu_cap`` bytes each on one host, each process's host cap, its rates."""
    gpus: int
    gpu_cap: int
    host_cap: int | None
    costs: StreamCosts          # sustained FLOP/s, per-pass overhead, the host link
    peer_bytes_s: float         # what one GPU moves in a ring collective with its peers (data and pipeline parallel)
    base_rss: int = GIB         # a process before loading
    expandable: bool = True     # the allocator's expandable segments (``core.machine.allocator_setting``)
    tp_bytes_s: float | None = None  # the same inside a tensor-parallel group, where it differs (default: peer)
    node_host: int | None = None  # host memory the run's processes share, evenly (``search.on``); None: unchecked
    card_bytes: int | None = None  # each GPU's own memory, which no cap passes (a cap given may be less); None: unknown


def options(pinned: Any, planned: tuple) -> tuple:
    """What the search tries of a setting: the one ``pinned``, or every ``planned`` one."""
    return planned if pinned is None else (pinned,)


def resident(ask: Ask, box: Box) -> Iterator[Plan]:
    """The resident trainer on one GPU, or replicated over all of them (DDP, ZeRO-1/2/3)."""
    p, dp = ask.pins, box.gpus
    if p.stream or (p.tp or 1) * (p.pp or 1) > 1 or p.dp not in (None, dp) or ask.batch % dp:
        return
    eager_zero3 = ask.compile is None  # by default ZeRO-3 may still recompute every unit, its least memory
    for states in options(p.states, ("gpu", "cpu")):
        for recompute in options(p.recompute, RESIDENT_POLICIES):
            for zero in options(p.zero, (0, 1, 2, 3) if dp > 1 else (0,)):
                if zero == 3 and ask.lora or zero and dp == 1:
                    continue
                if ask.compiled and recompute != "none" and not (eager_zero3 and zero == 3 and recompute == "every"):
                    continue
                for hold in options(p.hold, (False, True) if zero == 3 else (False,)):
                    if hold and zero != 3:
                        continue
                    for mb in options(p.micro_batch, tuple(divisors(ask.batch // dp))):
                        plan = _resident(ask, box, states, recompute, zero, mb, hold)
                        if plan is not None:
                            yield plan


def _resident(ask: Ask, box: Box, states: str, recompute: str, zero: int, mb: int, hold: bool = False
              ) -> Plan | None:
    dp, on_gpu, policy = box.gpus, states == "gpu", RecomputePolicy.parse(recompute)
    if (ask.batch // dp) % mb:
        return None
    if ask.lora:
        gpu, host = _adapted(ask, box, policy, mb, on_gpu)
    else:
        if dp == 1:  # the resident trainer's own footprint; ZeRO's over several ranks
            held = state_bytes(ask.cfg, ask.adam_bits, 2 if ask.exact_skip else 1) if on_gpu else 0
            gpu = estimate(ask.cfg, mb, ask.seq, policy, ask.dtype_bytes, states=held, compiled=ask.compiled)
        else:
            gpu = zero_estimate(ask.cfg, dp, zero, mb, ask.seq, recompute, ask.dtype_bytes, ask.adam_bits, on_gpu,
                                ask.exact_skip, ask.reduce_bytes, ask.compiled, hold)
        host = plan_resident_host(ask.cfg, mb, ask.seq, policy, ask.adam_bits, not on_gpu, True, box.base_rss,
                                  fp16=ask.fp16, shards=dp if zero else 1, exact_skip=ask.exact_skip,
                                  compiled=ask.compiled and policy.kind == "none")
        # each rank keeps its share of each leaf as it reads it (``data_parallel.shards.take``); one process, all of
        # it: with masters on the GPU each leaf passes through host memory alone (``core.frozen.trainable``)
        host = with_rank_load(host, ask, box, 0 if on_gpu else 1 / (dp if zero else 1))
    if not fits(gpu.total, box.gpu_cap, box.expandable, dp) or box.host_cap is not None and host.total > box.host_cap:
        return None
    c = box.costs
    step = zero_step_s(ask.cfg, dp, zero, ask.batch, ask.seq, mb, recompute, c.flops, c.pass_overhead_s,
                       box.peer_bytes_s, ask.dtype_bytes, ask.reduce_bytes, on_gpu, hold)
    return Plan("resident" if dp == 1 else "data-parallel", mb, states, recompute, step, gpu.total, host.total,
                dp=dp, zero=zero, hold=hold, detail=gpu, host_detail=host.detail)


def with_rank_load(host: HostPlan, ask: Ask, box: Box, share: float) -> HostPlan:
    """A process's host peak (a data-parallel rank's, or the one resident process's: ``share`` 1 with its masters
    in host memory, 0 with them on the GPU): ``host`` while it trains, or its load where that is more (``rank_load``,
    keeping ``share`` of the masters and moments, beside CUDA's libraries and the process)."""
    load = rank_load(ask.cfg, ask.dtype_bytes, ask.adam_bits, share) + CUDA_RUNTIME_BYTES + box.base_rss
    return HostPlan(max(host.total, load), f"{host.detail}; while loading, its share and a leaf in flight "
                                           f"{load / GIB:.2f} GiB")


@functools.cache
def rank_load(cfg: Any, dtype_bytes: int, adam_bits: int, share: float) -> int:
    """A data-parallel rank's load (``core.leaves.rank_load_bytes``), keeping on the host ``share`` of each leaf's
    masters and moments (0 where they live on the GPU): the same for every micro-batch and recompute the search
    tries, so counted once per layout."""
    spec = model_spec(cfg)

    def kept(path: str) -> float:
        return share * (4 * math.prod(spec.leaf(path).shape) + leaf_moment_bytes(spec, path, adam_bits))

    return rank_load_bytes(spec, dtype_bytes, kept)


def _adapted(ask: Ask, box: Box, policy: RecomputePolicy, mb: int, on_gpu: bool) -> tuple[MemoryPlan, HostPlan]:
    """A resident LoRA rank's GPU and host bytes: the frozen base and the pairs, whose masters and moments (alone)
    sit on the GPU or in host memory. Its activations are the eager count's even where blocks are compiled: what
    inductor saves beside frozen matrices and their pairs is not counted yet."""
    spec = model_spec(ask.cfg)
    held = (2 if ask.exact_skip else 1) * adapter_state_bytes(spec, ask.adam_bits)
    gpu = lora_estimate(spec, mb, ask.seq, policy, ask.dtype_bytes, ask.base_bits, held if on_gpu else 0)
    base = plan_resident_host(ask.cfg, mb, ask.seq, policy, ask.adam_bits, False, True, box.base_rss,
                              compiled=ask.compiled and policy.kind == "none")
    state = 0 if on_gpu else held
    load = lora_load_bytes(spec, ask.dtype_bytes, ask.base_bits, ask.adam_bits, streamed=False)  # the base to the GPU
    detail = base.detail + (f" + the pairs' masters and moments {held / GIB:.2f} GiB" if state else "")
    return gpu, HostPlan(base.total + max(state, load), f"{detail}; while loading, the pairs and a leaf in flight "
                                                          f"{load / GIB:.2f} GiB")


def streams(ask: Ask, box: Box) -> bool:
    """Whether streaming is a candidate: on one GPU or over several (ZeRO-Offload) unless masters and moments are
    pinned to the GPU, and not for adapters over several (they stream on one GPU)."""
    p = ask.pins
    # over several GPUs the state is sharded as ZeRO-2 shards it: planned, or --stream with --zero 2 (or 0: the same);
    # a stage given without --stream is the resident engine's
    sharded = not p.zero if box.gpus == 1 else p.zero is None or p.stream and p.zero in (0, 2)
    return ((p.tp or 1) * (p.pp or 1) == 1 and p.dp in (None, box.gpus) and sharded and ask.batch % box.gpus == 0
            and not p.hold
            and (p.stream or p.states != "gpu") and not (ask.lora and box.gpus > 1))


def stream_job(ask: Ask, box: Box) -> StreamJob:
    """The streamed engine's job: each rank's rows, 1/N of the state in each rank's host memory (an adapted spec's:
    its base model's, trained whole)."""
    cfg = model_spec(ask.cfg).cfg if ask.lora else ask.cfg
    return StreamJob(cfg, ask.batch // box.gpus, ask.seq, ask.adam_bits, dtype_bytes=ask.dtype_bytes,
                     shards=box.gpus, deferred=ask.deferred, base_rss=box.base_rss, expandable=box.expandable,
                     compiled=ask.compiled)


def stream_pins(ask: Ask, box: Box) -> tuple:
    """``search_streaming``'s kept choices: micro-batch, tail, tail micro-batch, staged ends (a sharded optimizer
    stages none)."""
    p = ask.pins
    return p.micro_batch, p.tail, p.tail_micro_batch, False if box.gpus > 1 else None


def streamed(ask: Ask, box: Box) -> Iterator[Plan]:
    """Weights streamed block by block, masters and moments in host memory (one GPU; over several, ZeRO-Offload)."""
    if not streams(ask, box):
        return
    dp = box.gpus
    job = stream_job(ask, box)
    if ask.lora:
        yield from _streamed_adapted(ask, box, job)
        return
    try:
        ranked = search_streaming(job, box.gpu_cap, box.host_cap, box.costs, *stream_pins(ask, box))
    except MemoryError:
        return
    for r in ranked:
        c = r.plan.choice
        yield Plan("streamed", c.micro_batch, "cpu", "every", r.step_s, r.plan.device_bytes, r.plan.host_bytes,
                   dp=dp, zero=2 if dp > 1 else 0, tail=c.tail, tail_micro_batch=c.tail_micro_batch, detail=r.plan)


def _streamed_adapted(ask: Ask, box: Box, job: StreamJob) -> Iterator[Plan]:
    """An adapted spec streamed on one GPU: the base model's choices (``stream.search.choices``: micro-batch, and a
    tail and its passes where ``--tail`` is given), each with the fewest block inputs in host memory whose adapters'
    bytes (``streamed_lora_bytes``, the tail's counted) fit the GPU; the step a frozen base's
    (``stream.search.predict_frozen``)."""
    spec = model_spec(ask.cfg)
    load = lora_load_bytes(spec, ask.dtype_bytes, ask.base_bits, ask.adam_bits)  # the base and pairs kept, a leaf
    kept = stored(spec, ask.dtype_bytes, ask.base_bits, ask.adam_bits)
    mb, tail, tail_mb, staged = stream_pins(ask, box)
    # a tail only where given: the count of its head phase is not yet bounded by a run (on the CPU it fell up to 10%
    # short of what was allocated there; the plans it allows sit near the cap, unmeasured on a GPU)
    for choice in choices(job, mb, 0 if tail is None else tail, tail_mb, staged):
        for plan in by_host_inputs(job, choice):
            held = streamed_lora_bytes(spec, kept, job.batch, choice.micro_batch, ask.seq, plan.on_host, choice.tail,
                                       choice.tail_micro_batch, job.chunk)
            if fits(held.gpu, box.gpu_cap, box.expandable):
                break
        else:
            continue
        ends = (("CUDA libraries", CUDA_RUNTIME_BYTES), ("process", box.base_rss))
        host = replace(plan, host=(("base and pairs' masters and moments", held.host - plan.on_host * job.boundary),
                                   ("host block inputs", plan.on_host * job.boundary), ("compiling", job.compiling),
                                   *ends),
                       load_bytes=load + sum(b for _, b in ends))  # the adapters' host bytes, by class, and the load's
        if box.host_cap is None or host.host_bytes <= box.host_cap:
            step_s = predict_frozen(plan, box.costs, spec, kept).step_s
            yield Plan("streamed", choice.micro_batch, "cpu", "every", step_s, held.gpu, host.host_bytes,
                       tail=choice.tail, tail_micro_batch=choice.tail_micro_batch, detail=host)
