"""The fine-tuning run's memory plans: resident (the micro-batch a GPU cap allows), data-parallel (each GPU
under DDP or a ZeRO stage), streamed (micro-batch, tail and host boundaries predicted fastest within the caps),
and the trainer configuration they give."""
from __future__ import annotations

import argparse
from typing import Any

import torch

from nanotrain.data_parallel import launch as dp
from nanotrain.memory.plan import (CUDA_RUNTIME_BYTES, GIB, StreamPlan, choose_micro_batch, estimate, host_rss_gib,
                                   plan_resident_host, plan_streaming, return_freed_memory_to_the_os, set_gpu_cap)
from nanotrain.memory.recompute import RecomputePolicy
from nanotrain.memory.stream_search import StreamCosts, format_ranked, measure_link, search_streaming
from nanotrain.memory.zero_plan import ZeroPlan, plan_zero
from nanotrain.train.resident import TrainConfig
from nanotrain.train.streamed import StreamConfig


def cpu_stream_micro_batch(args: argparse.Namespace) -> int:
    batch = args.batch // args.dp  # each data-parallel rank's share
    return args.micro_batch or max(d for d in range(1, min(batch, 8) + 1) if batch % d == 0)


def dp_memory_plan(args: argparse.Namespace, cfg: Any) -> ZeroPlan:
    """Each GPU's plan at --dp N --zero S under --gpu-mem-gib (MemoryError naming what would fit)."""
    return plan_zero(cfg, args.dp, args.zero, args.batch, args.seq, args.recompute, int(args.gpu_mem_gib * GIB),
                     args.micro_batch, dtype_bytes=4 if args.dtype == "fp32" else 2, state_bits=args.adam_bits,
                     states_on_gpu=args.states == "gpu", exact_skip=args.dtype == "fp16",
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
    if args.micro_batch:
        plan = estimate(cfg, args.micro_batch, args.seq, policy, nbytes)
        if plan.total > cap:
            print(f"warning: the estimate for {plan.describe()} is above the {args.gpu_mem_gib} GiB cap", flush=True)
        return args.micro_batch
    plan = choose_micro_batch(cfg, batch, args.seq, policy, cap, nbytes)
    print(f"memory plan under {args.gpu_mem_gib} GiB: {plan.describe()}", flush=True)
    return plan.micro_batch


def plan_stream(args, cfg, device: torch.device, dtype: torch.dtype, ctx=None) -> StreamPlan:
    """The streaming plan within the caps; without --tail, the one ``stream_search`` predicts fastest
    (it sets ``args.tail`` and ``args.tail_micro_batch`` to the plan's)."""
    return_freed_memory_to_the_os()  # before loading: the host budget is counted in RSS
    if device.type != "cuda":
        args.tail = args.tail or 0
        return StreamPlan(cpu_stream_micro_batch(args), 0, 0, 0, "on the CPU: nothing to plan")
    gpu_cap = int((args.gpu_mem_gib or torch.cuda.get_device_properties(device).total_memory / GIB) * GIB)
    host_cap = None if args.host_mem_gib is None else int(args.host_mem_gib * GIB)
    base = int(host_rss_gib()[0] * GIB) + CUDA_RUNTIME_BYTES
    common = dict(dtype_bytes=torch.empty((), dtype=dtype).element_size(), micro_batch=args.micro_batch,
                  base_rss=base, tail_mb=args.tail_micro_batch, shards=dp.state_shards(args),
                  deferred=args.clip_norm is not None or args.dtype == "fp16")
    batch = args.batch // args.dp
    if args.tail is None:
        link = torch.tensor([measure_link(device)], device=device, dtype=torch.float64)
        if ctx is not None:  # every data-parallel rank must pick the same plan
            torch.distributed.all_reduce(link, op=torch.distributed.ReduceOp.MIN, group=ctx.grid.dp_group)
        costs = StreamCosts(link_bytes_s=link.item())
        ranked = search_streaming(cfg, batch, args.seq, gpu_cap, host_cap, args.adam_bits, costs, **common)
        print(f"streaming plans by predicted step time (host link {costs.link_bytes_s / 1e9:.1f} GB/s measured; "
              f"--tail N and --micro-batch M fix them):\n{format_ranked(ranked, batch)}", flush=True)
        plan, args.tail, args.tail_micro_batch = ranked[0].plan, ranked[0].tail, ranked[0].tail_micro_batch
    else:
        plan = plan_streaming(cfg, batch, args.seq, gpu_cap, host_cap, args.adam_bits, tail=args.tail, **common)
    if args.gpu_mem_gib is not None:
        set_gpu_cap(args.gpu_mem_gib, device)
    print(f"streaming plan: {plan.describe()}", flush=True)
    return plan


def train_config(args, micro: int, plan: StreamPlan | None) -> TrainConfig | StreamConfig:
    """The streaming trainer's configuration when there is a streaming plan, else the resident one's."""
    if plan is not None:
        return StreamConfig(args.batch, plan.micro_batch, plan.on_host, compile=args.compile, tail=args.tail,
                            tail_micro_batch=args.tail_micro_batch, clip_norm=args.clip_norm)
    return TrainConfig(batch=args.batch, micro_batch=micro, checkpoint=args.recompute, compile=args.compile,
                       clip_norm=args.clip_norm)
