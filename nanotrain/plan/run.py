"""The fine-tuning run's plan: what its flags ask (``ask``), this machine (``box``), the search's pick
(``plan_run``, printed before anything loads), and the trainer configuration it gives."""
from __future__ import annotations

from dataclasses import replace

import argparse
from typing import Any

import torch

from nanotrain.data_parallel import launch as dp
from nanotrain.core.flops import peak_flops
from nanotrain.core.footprint import divisors, plan_resident_host
from nanotrain.core.machine import (CUDA_CONTEXT_BYTES, GIB, host_available, host_rss_gib,
                                    return_freed_memory_to_the_os, set_gpu_cap)
from nanotrain.core.models import model_spec
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.core.train.resident import TrainConfig
from nanotrain.plan.plan import Plan
from nanotrain.plan.report import Machine, plan_table
from nanotrain.plan.candidates import Ask, Box, Pins
from nanotrain.plan.search import ranked, search, worlds
from nanotrain.stream.footprint import StreamChoice, StreamJob, StreamPlan
from nanotrain.stream.footprint import estimate as stream_estimate
from nanotrain.stream.search import GPUS, StreamCosts, measure_link
from nanotrain.stream.config import StreamConfig
def cpu_stream_micro_batch(args: argparse.Namespace) -> int:
    batch = args.batch // args.dp  # each data-parallel rank's share
    return args.micro_batch or divisors(batch, 8)[-1]


def exact_skip(args: argparse.Namespace) -> bool:
    """Whether the resident optimizer keeps a second copy of masters and moments: for speculative clipping,
    and for fp16 under data parallelism (an overflow on any rank's unit skips the step on all of them). One
    process with fp16 hands its units over after the backward's finite check instead."""
    return args.clip_overlap or (args.dtype == "fp16" and args.dp > 1)


def check_resident_host(args: argparse.Namespace, cfg: Any, micro: int, policy: RecomputePolicy,
                        on_gpu: bool) -> None:
    """Refuse (MemoryError) a resident run whose host memory cannot fit --host-mem-gib."""
    if args.host_mem_gib is None:
        return
    plan = plan_resident_host(cfg, micro, args.seq, policy, args.adam_bits, args.states == "cpu" or not on_gpu,
                              on_gpu, int(host_rss_gib()[0] * GIB), fp16=args.dtype == "fp16",
                              shards=dp.state_shards(args), exact_skip=exact_skip(args))
    if plan.total > args.host_mem_gib * GIB:
        raise MemoryError(f"{args.model} needs about {plan.describe()} of host memory, more than --host-mem-gib "
                          f"{args.host_mem_gib}; raise it, or use --adam-bits 8, a smaller --micro-batch or a "
                          f"smaller model")


def stream_job(cfg: Any, args: argparse.Namespace, base_rss: int, expandable: bool, batch: int | None = None,
               shards: int = 1) -> StreamJob:
    """The streaming job of a command line (``tasks.finetune``'s flags, ``tasks.plan``'s): this process's batch
    and state."""
    return StreamJob(cfg, batch or args.batch, args.seq, args.adam_bits, dtype_bytes=4 if args.dtype == "fp32" else 2,
                     shards=shards, deferred=args.clip_norm is not None or args.dtype == "fp16", base_rss=base_rss,
                     expandable=expandable, compiled=bool(args.compile))


def ask(args: Any, cfg: Any, pinned: frozenset[str], free_layout: bool = False, on_gpu: bool = True,
        gpus: int | None = None) -> Ask:
    """What the run asks of a plan: the model (with ``--lora-rank`` the adapted spec, ``run.lora.model``) and the
    numerics its flags chose, and the settings they pin (given on the command line, in ``--config`` or by the
    checkpoint resumed); the rest is the plan's. The layout (--dp, --tp, --pp) is the run's world unless
    ``free_layout`` (``--plan auto``, or the GPUs the launcher found: only those given are kept, on ``gpus`` GPUs,
    or None: on as many as the search finds fastest)."""
    pick = lambda dest: getattr(args, dest) if dest in pinned else None  # noqa: E731
    layout = pick if free_layout else lambda dest: getattr(args, dest)  # noqa: E731
    pins = Pins(stream=args.stream, states=pick("states"), recompute=pick("recompute"), micro_batch=pick("micro_batch"),
                tail=args.tail, tail_micro_batch=args.tail_micro_batch, dp=layout("dp"),
                zero=pick("zero") if free_layout or args.dp > 1 else 0, hold=pick("hold_weights"),
                tp=layout("tp"), pp=layout("pp"),
                schedule=pick("schedule"), gpus=gpus if free_layout else args.dp * args.tp * args.pp)
    fp16, fp32 = args.dtype == "fp16", args.dtype == "fp32" or args.dtype == "auto" and not on_gpu
    return Ask(cfg, args.batch, args.seq, args.adam_bits, 4 if fp32 else 2, fp16,
               deferred=args.clip_norm is not None or fp16, exact_skip=exact_skip(args),
               compile=args.compile if "compile" in pinned or not args.compile else None,
               reduce_bytes=2 if args.dp_reduce_dtype == "bf16" else 4, pins=pins, base_bits=args.lora_base_bits)


def box(args: Any, device: torch.device, expandable: bool, ctx: Any = None, gpus: int | None = None) -> Box:
    """This machine as the search sees it: the run's GPUs under the cap (default: the card's memory), each
    process's host cap, the host link measured (the slowest rank's, so that every rank picks the same plan).
    ``gpus``: the launcher's count of this machine's GPUs, planned over before any rank starts; it measures no link
    (that would hold a CUDA context on the first GPU beside its rank), the card's datasheet link stands in."""
    name = torch.cuda.get_device_name(device)
    card = next((g for key, g in GPUS.items() if key in name), None)
    card_bytes = torch.cuda.get_device_properties(device).total_memory
    gpu_cap = int(args.gpu_mem_gib * GIB) if args.gpu_mem_gib else card_bytes
    if gpus is None:
        link = torch.tensor([measure_link(device)], device=device, dtype=torch.float64)
        if ctx is not None:
            torch.distributed.all_reduce(link, op=torch.distributed.ReduceOp.MIN)
        link_bytes_s = link.item()
    else:
        link_bytes_s = card.link_bytes_s if card else StreamCosts().link_bytes_s
    return_freed_memory_to_the_os()  # before loading: the host budget is counted in RSS
    host_cap = None if args.host_mem_gib is None else int(args.host_mem_gib * GIB)
    # without --host-mem-gib, the host's available memory, shared by the plan's processes; not inside ranks already
    # started (each would read another amount, and they must agree): the launcher planned their layout before them
    node_host = host_available() if host_cap is None and ctx is None else None
    base_rss = int(host_rss_gib()[0] * GIB) + (CUDA_CONTEXT_BYTES if gpus is not None else 0)  # the ranks' context
    return Box(gpus or args.dp * args.tp * args.pp, gpu_cap, host_cap, StreamCosts(link_bytes_s=link_bytes_s),
               card.peer_bytes_s if card else 25e9, base_rss, expandable, node_host=node_host, card_bytes=card_bytes)


def plan_run(args: argparse.Namespace, pinned: frozenset[str], cfg: Any, device: torch.device,
             allocator: tuple[bool, str], ctx: Any = None) -> Plan:
    """The plan this run takes: on a GPU the search's fastest within the caps, its table printed before anything
    loads; on the CPU (no step-time model) the resident trainer, or the streamed one with ``--stream``, as given.
    A cap no plan meets is refused (MemoryError, one line naming what would fit)."""
    if device.type != "cuda":
        states, micro = args.states or "cpu", args.micro_batch or args.batch // args.dp
        if args.stream:
            job = stream_job(cfg, args, 0, False, batch=args.batch // args.dp, shards=dp.state_shards(args))
            sp = stream_estimate(job, StreamChoice(cpu_stream_micro_batch(args), tail=args.tail or 0))
            return Plan("streamed", sp.micro_batch, "cpu", "every", 0.0, sp.device_bytes, sp.host_bytes, dp=args.dp,
                        zero=args.zero, tail=args.tail or 0, tail_micro_batch=args.tail_micro_batch, detail=sp)
        engine = "3d" if args.tp * args.pp > 1 else "resident" if args.dp == 1 else "data-parallel"
        return Plan(engine, micro, states, args.recompute, 0.0, 0, None, dp=args.dp, zero=args.zero,
                    hold=args.hold_weights, tp=args.tp, pp=args.pp, schedule=args.schedule, sp=args.sp)
    plan = pick(args, pinned, cfg, box(args, device, allocator[0], ctx), torch.cuda.get_device_name(device),
                allocator[1])
    if args.gpu_mem_gib is not None:
        set_gpu_cap(args.gpu_mem_gib, device)
    return plan


def pick(args: Any, pinned: frozenset[str], cfg: Any, machine: Box, card: str, allocator: str,
         free_layout: bool = False, on_gpu: bool = True, gpus: int | None = None) -> Plan:
    """The search's fastest plan on ``machine`` (a GPU named ``card``), printed: the five fastest, then the pick's
    table as ``tasks.plan`` prints it, and the pick with the flags that pin it."""
    asked = ask(args, cfg, pinned, free_layout, on_gpu, gpus)
    plan = searched(asked, machine)[0]
    named = Machine(f"{card}, host link measured", machine.costs, peak_flops(card))
    print(plan_table(plan, asked, machine, named, allocator, args.model), flush=True)
    print(f"plan: {plan.describe()}", flush=True)
    return plan


def pick_gpus(args: Any, pinned: frozenset[str], cfg: Any, device: torch.device, expandable: bool, gpus: int,
              given: bool) -> Plan:
    """The launcher's plan over this machine's ``gpus`` GPUs (``given``: ``--gpus``, taken whole; else found, and
    the run takes as many as the fastest plan does): the five fastest printed, then the pick's flags, which the
    ranks started here are given, with the fastest predicted step at each GPU count (the why)."""
    asked = ask(args, cfg, pinned, True, True, gpus if given else None)
    machine = box(args, device, expandable, gpus=gpus)
    plans = searched(asked, machine)
    print(f"{f'--gpus {gpus} given' if given else f'{gpus} GPUs found'}; {by_gpu_count(plans, worlds(asked, machine))}",
          flush=True)
    return plans[0]


def by_gpu_count(plans: list[Plan], counts: range) -> str:
    """The pick, and why: the fastest predicted step at each GPU count the search ranked (``counts``)."""
    plan = plans[0]
    best = {n: min((q.step_s for q in plans if q.world == n), default=None) for n in counts}
    steps = ", ".join(f"{n}: {'none fits' if s is None else f'{s:.3f} s'}" for n, s in best.items())
    return (f"plan over {plan.world} GPU{'s' if plan.world > 1 else ''}: {plan.flags()} (the fastest predicted step "
            f"by GPU count: {steps})")


def searched(asked: Ask, machine: Box) -> list[Plan]:
    """Every plan that fits ``machine``, fastest first, the five fastest printed. A micro-batch given that fits no
    cap is run as given, said in a warning (the caps are still enforced)."""
    try:
        found = search(asked, machine)
    except MemoryError as e:
        if asked.pins.micro_batch is None:
            raise
        # A micro-batch given is run as given, as it was before the one search: the estimate can err by the
        # margin (gpt2-xl at 11/16 GiB, micro-batch 8: 0.1 GiB over on the host, measured 14.2 GiB); said, not refused.
        for relaxed in (replace(machine, host_cap=None), replace(machine, gpu_cap=1 << 60, host_cap=None)):
            found = ranked(asked, relaxed)  # the GPU cap kept where it can be (it is enforced)
            if found:
                break
        else:
            raise
        print(f"warning: {e}; running --micro-batch {asked.pins.micro_batch} as given (the caps are still enforced)",
              flush=True)
    print("plans by predicted step time (a flag given pins its setting):\n"
          + "\n".join(f"  {q.describe()}" for q in found[:5]) + f"\n  ({len(found)} plans fit)", flush=True)
    return found


def staged_units(cfg: Any, plan: Plan) -> tuple[str, ...]:
    """The units the plan stages (``stream.staged``): the embedding and the head, or none (a frozen base's
    ends have no update to stage)."""
    spec = model_spec(cfg)
    staged = plan.engine == "streamed" and plan.detail.choice.staged_ends and not spec.frozen
    return (spec.embed_unit.name, spec.head_unit.name) if staged else ()


def train_config(args: Any, plan: Plan) -> TrainConfig | StreamConfig:
    """The streaming trainer's configuration for a streamed plan, else the resident one's."""
    if plan.engine == "streamed":
        sp: StreamPlan = plan.detail
        return StreamConfig(args.batch, sp.micro_batch, sp.on_host, chunk_tokens=sp.job.chunk, compile=args.compile,
                            tail=plan.tail, tail_micro_batch=plan.tail_micro_batch, clip_norm=args.clip_norm)
    return TrainConfig(batch=args.batch, micro_batch=plan.micro_batch, recompute=plan.recompute, compile=args.compile,
                       clip_norm=args.clip_norm)
