"""The fine-tuning run's memory plans: resident (the micro-batch a GPU cap allows), data-parallel (each GPU
under DDP or a ZeRO stage), streamed (micro-batch, tail and host boundaries predicted fastest within the caps),
and the trainer configuration they give."""
from __future__ import annotations

import argparse
from typing import Any

import torch

from nanotrain.data_parallel import launch as dp
from nanotrain.core.flops import peak_flops
from nanotrain.core.footprint import (GIB, choose_micro_batch, divisors, estimate, host_rss_gib, plan_resident_host,
                                   return_freed_memory_to_the_os, set_gpu_cap, state_bytes)
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.plan.report import Machine, stream_table
from nanotrain.stream.footprint import StreamChoice, StreamJob, StreamPlan
from nanotrain.stream.footprint import estimate as stream_estimate
from nanotrain.stream.search import StreamCosts, format_ranked, measure_link, search_streaming
from nanotrain.core.models import model_spec
from nanotrain.data_parallel.footprint import ZeroPlan, plan_zero
from nanotrain.core.train.resident import TrainConfig
from nanotrain.stream.config import StreamConfig
def cpu_stream_micro_batch(args: argparse.Namespace) -> int:
    batch = args.batch // args.dp  # each data-parallel rank's share
    return args.micro_batch or divisors(batch, 8)[-1]


def dp_memory_plan(args: argparse.Namespace, cfg: Any) -> ZeroPlan:
    """Each GPU's plan at --dp N --zero S under --gpu-mem-gib (MemoryError naming what would fit)."""
    return plan_zero(cfg, args.dp, args.zero, args.batch, args.seq, args.recompute, int(args.gpu_mem_gib * GIB),
                     args.micro_batch, dtype_bytes=4 if args.dtype == "fp32" else 2, state_bits=args.adam_bits,
                     states_on_gpu=args.states == "gpu", exact_skip=exact_skip(args),
                     reduce_bytes=2 if args.dp_reduce_dtype == "bf16" else 4)


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


def plan_micro_batch(args, cfg, device: torch.device, dtype: torch.dtype) -> int:
    policy = RecomputePolicy.parse(args.recompute)
    batch = args.batch // args.dp  # each data-parallel rank's share
    if args.gpu_mem_gib is None or device.type != "cuda":
        return args.micro_batch or batch
    cap = int(args.gpu_mem_gib * GIB)
    set_gpu_cap(args.gpu_mem_gib, device)
    if args.dp > 1:  # it fits: check_args refused it otherwise
        zplan = dp_memory_plan(args, cfg)
        print(f"memory plan under {args.gpu_mem_gib} GiB per GPU: {zplan.describe()}", flush=True)
        return zplan.micro_batch
    nbytes = torch.empty((), dtype=dtype).element_size()
    states = state_bytes(cfg, args.adam_bits, 2 if exact_skip(args) else 1) if args.states == "gpu" else 0
    if args.micro_batch:
        plan = estimate(cfg, args.micro_batch, args.seq, policy, nbytes, states=states)
        if plan.total > cap:
            print(f"warning: the estimate for {plan.describe()} is above the {args.gpu_mem_gib} GiB cap", flush=True)
        return args.micro_batch
    plan = choose_micro_batch(cfg, batch, args.seq, policy, cap, nbytes, states)
    print(f"memory plan under {args.gpu_mem_gib} GiB: {plan.describe()}", flush=True)
    return plan.micro_batch


def stream_job(cfg: Any, args: argparse.Namespace, base_rss: int, expandable: bool, batch: int | None = None,
               shards: int = 1) -> StreamJob:
    """The streaming job of a command line (``tasks.finetune``'s flags, ``tasks.plan``'s): this process's batch
    and state."""
    return StreamJob(cfg, batch or args.batch, args.seq, args.adam_bits, dtype_bytes=4 if args.dtype == "fp32" else 2,
                     shards=shards, deferred=args.clip_norm is not None or args.dtype == "fp16", base_rss=base_rss,
                     expandable=expandable)


def plan_stream(args, cfg, device: torch.device, allocator: tuple[bool, str], ctx=None) -> StreamPlan:
    """The streaming plan within the caps that ``stream_search`` predicts fastest, its table printed before
    anything loads (it sets ``args.tail`` and ``args.tail_micro_batch`` to the plan's). Refused in one line
    (MemoryError) when none fits."""
    return_freed_memory_to_the_os()  # before loading: the host budget is counted in RSS
    base = int(host_rss_gib()[0] * GIB)  # the process before loading; the plan adds CUDA's libraries
    shards = dp.state_shards(args)
    job = stream_job(cfg, args, base, allocator[0], batch=args.batch // args.dp, shards=shards)
    if device.type != "cuda":
        args.tail = args.tail or 0
        return stream_estimate(job, StreamChoice(cpu_stream_micro_batch(args), tail=args.tail))
    gpu_cap = int((args.gpu_mem_gib or torch.cuda.get_device_properties(device).total_memory / GIB) * GIB)
    host_cap = None if args.host_mem_gib is None else int(args.host_mem_gib * GIB)
    link = torch.tensor([measure_link(device)], device=device, dtype=torch.float64)
    if ctx is not None:  # every data-parallel rank must pick the same plan
        torch.distributed.all_reduce(link, op=torch.distributed.ReduceOp.MIN, group=ctx.grid.dp_group)
    costs = StreamCosts(link_bytes_s=link.item())
    ranked = search_streaming(job, gpu_cap, host_cap, costs, args.micro_batch, args.tail, args.tail_micro_batch,
                              staged=False if shards > 1 else None)  # a sharded optimizer stages nothing
    name = torch.cuda.get_device_name(device)
    print(f"streaming plans by predicted step time (--tail N and --micro-batch M fix them):\n"
          f"{format_ranked(ranked, job.batch)}", flush=True)
    print(stream_table(ranked[0], Machine(f"{name}, host link measured", costs, peak_flops(name)), gpu_cap, host_cap,
                       allocator[1], args.model), flush=True)
    args.tail, args.tail_micro_batch = ranked[0].plan.choice.tail, ranked[0].plan.choice.tail_micro_batch
    if args.gpu_mem_gib is not None:
        set_gpu_cap(args.gpu_mem_gib, device)
    return ranked[0].plan


def staged_units(cfg: Any, plan: StreamPlan | None) -> tuple[str, ...]:
    """The units the plan stages (``stream.staged``): the embedding and the head, or none."""
    spec = model_spec(cfg)
    return (spec.embed_unit.name, spec.head_unit.name) if plan is not None and plan.choice.staged_ends else ()


def train_config(args, micro: int, plan: StreamPlan | None) -> TrainConfig | StreamConfig:
    """The streaming trainer's configuration when there is a streaming plan, else the resident one's."""
    if plan is not None:
        return StreamConfig(args.batch, plan.micro_batch, plan.on_host, chunk_tokens=plan.job.chunk,
                            compile=args.compile, tail=args.tail, tail_micro_batch=args.tail_micro_batch,
                            clip_norm=args.clip_norm)
    return TrainConfig(batch=args.batch, micro_batch=micro, recompute=args.recompute, compile=args.compile,
                       clip_norm=args.clip_norm)
