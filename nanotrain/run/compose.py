"""Tensor x pipeline x data parallelism in the fine-tuning run: ``--tp T --pp P`` (with ``--dp D``) train with
``nanotrain.compose`` through the run every trainer shares (data, loop, lr schedule, validation, dashboard,
profile, pre-emption, checkpoints), on T x P x D processes (torchrun's, or started here).

Each stage's blocks are tensor-parallel over ``--tp`` ranks (``--sp``: sequence parallelism, ``--tp-overlap``:
collectives overlapped with matmuls), ``--pp`` ranks run the stages under ``--schedule``, the whole replicated
``--dp`` times (``--zero 1/2``). Each replica takes its slice of the global batch in micro-batches of
``--micro-batch`` (default: planned on a GPU; without one as many as divide it, up to 4 per pipeline rank).
``--plan auto`` lets the one search (``nanotrain.plan``: every engine, ``compose.planner``'s layouts among them)
pick the layout for the launched processes (or ``--gpus``) from ``--gpu-mem-gib`` (default:
the GPU's, or 80 GiB planning on a machine without one), ``--flops``, ``--tp-gbps``, ``--link-gbps`` and
``--layer-overhead-ms``; the run saves the layout picked (a resume keeps it), and tp = pp = 1 is an ordinary run.

What the 3D trainer does not do is refused in one line before any process starts (``check_layout``); it resumes
what a run of any layout saved (``nanotrain.checkpoint``). It clips (``--clip-norm``) and scales fp16's loss
(``--dtype fp16``) as one process does: its units' updates wait for the whole model's gradient norm.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from nanotrain.run.cli import fail
from nanotrain.data_parallel import launch as dp
from nanotrain.data_parallel.config import stage_name
from nanotrain.distributed import DistContext, GridConfig, parse_order
from nanotrain.core.machine import GIB, set_gpu_cap
from nanotrain.core.models import family_of, model_spec
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.step import Trainer
from nanotrain.plan.candidates import Box
from nanotrain.plan.run import pick, pick_gpus
from nanotrain.run import lora
from nanotrain.stream.search import StreamCosts
from nanotrain.core.leaves import Leaves
# The engines (nanotrain.compose, nanotrain.pipeline, nanotrain.tensor_parallel) are imported in the functions that
# run them, which a run without --tp/--pp never calls: a one-process run does not load them.
# The flags that shape a 3D layout only, refused when given to a run without --tp or --pp above 1.
# The flags that set the layout: given (or resumed), the run takes it as they say; none given, it is planned.
LAYOUT = frozenset({"dp", "zero", "tp", "pp", "plan"})
LAYOUT_ONLY = {"sp": "--sp", "tp_overlap": "--tp-overlap", "sublayers": "--sublayers", "schedule": "--schedule",
               "virtual_stages": "--virtual-stages", "grid_order": "--grid-order"}


def add_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("tensor and pipeline parallelism (nanotrain.compose; with --dp: 3D)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per pipeline stage")
    g.add_argument("--pp", type=int, default=1, help="pipeline ranks")
    g.add_argument("--schedule", default="1f1b", help="the pipeline's schedule (nanotrain.pipeline.SCHEDULES; "
                                                      "an unknown one is refused, naming them)")
    g.add_argument("--virtual-stages", type=int, default=2, help="stages per pipeline rank (interleaved-1f1b)")
    g.add_argument("--sp", action="store_true", help="sequence parallelism inside each TP group")
    g.add_argument("--tp-overlap", action="store_true", help="TP collectives overlapped with their matmuls")
    g.add_argument("--sublayers", action="store_true", help="attention and MLP as separate pipeline layers")
    g.add_argument("--grid-order", default="tp-dp-pp", help="grid axes, innermost (adjacent ranks) first")
    g.add_argument("--plan", choices=("manual", "auto"), default="manual",
                   help="auto: the search (nanotrain.plan) picks --tp/--pp/--dp as well, for the launched processes "
                        "or --gpus (the rest is planned either way)")
    g.add_argument("--gpus", type=int, default=0,
                   help="GPUs to plan the layout over, taken whole (default: without a layout flag, every visible "
                        "CUDA GPU, as many taken as the fastest plan uses; 1: one GPU; --plan auto: its processes)")
    g.add_argument("--flops", type=float, default=None,
                   help="assumed FLOP/s per GPU (--plan auto; default the streamed model's 5e14, fitted on an H200 as "
                        "the 3D planner's was, docs/BENCHMARKS.md; 2e10 without CUDA): tasks.bench.model")
    g.add_argument("--tp-gbps", type=float, default=100.0, help="assumed GB/s per GPU in TP collectives (--plan auto)")
    g.add_argument("--link-gbps", type=float, default=25.0, help="assumed GB/s of PP and DP traffic (--plan auto)")
    g.add_argument("--layer-overhead-ms", type=float, default=None,
                   help="fixed ms per layer and pipeline action (--plan auto; default 0.15, fitted to gpt2-xl on an "
                        "H200: docs/BENCHMARKS.md, issue 19)")


def composed(args: argparse.Namespace) -> bool:
    """Whether the run is tensor- or pipeline-parallel (the 3D trainer), not one process or data parallelism."""
    return args.tp > 1 or args.pp > 1


def grid(args: argparse.Namespace) -> GridConfig:
    try:
        return GridConfig(args.tp, args.dp, args.pp, parse_order(args.grid_order))
    except ValueError as e:
        fail(str(e))


def micro_batches(args: argparse.Namespace) -> int:
    """Micro-batches per replica and step."""
    return args.batch // (args.dp * args.micro_batch)


def plan_layout(args: Any, pins: frozenset[str], cfg: Any, device: torch.device,
                expandable: bool) -> tuple[Any, frozenset[str], list[str]]:
    """The run's layout where it is planned: with --plan auto, the search's pick (``nanotrain.plan``) for the
    launched processes (or ``--gpus``), at the flags' rates (``--flops``, ``--tp-gbps``, ``--link-gbps``,
    ``--layer-overhead-ms``), so that every rank picks the same; without a layout flag on a machine of several GPUs
    (or with ``--gpus N``), the launcher's pick over them (``gpus_to_plan``). Returns the settings with the pick's
    in place, ``pins`` with the settings it decided (so the run builds that plan), and the flags the ranks started
    here are given (the pick's: they run it as if those were typed). Refused in one line when nothing fits."""
    if args.plan != "auto":  # torchrun's ranks plan no world: it is launched
        gpus, given = (1, False) if "RANK" in os.environ else gpus_to_plan(args, pins, visible_gpus(args, device))
        if gpus == 1:
            return args, pins, []
        try:
            plan = pick_gpus(args, pins, lora.model(args, cfg), device, expandable, gpus, given)
        except (MemoryError, ValueError) as e:
            fail(str(e))
        chosen = plan.settings()
        return replace(args, **chosen), pins | set(chosen), plan.flags().split() if plan.world > 1 else []
    world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else args.gpus or grid(args).size
    on_gpu = device.type == "cuda"
    mem = args.gpu_mem_gib or (torch.cuda.get_device_properties(device).total_memory / GIB if on_gpu else 80.0)
    fitted = StreamCosts()  # the measured rate and per-pass cost (``stream.search``; the 3D fit, issue 19, agrees)
    costs = StreamCosts(args.flops or (fitted.flops if on_gpu else 2e10),
                        fitted.pass_overhead_s if args.layer_overhead_ms is None else args.layer_overhead_ms / 1e3)
    box = Box(world, int(mem * GIB), None if args.host_mem_gib is None else int(args.host_mem_gib * GIB), costs,
              args.link_gbps * 1e9, tp_bytes_s=args.tp_gbps * 1e9,
              card_bytes=torch.cuda.get_device_properties(device).total_memory if on_gpu else None)
    card = torch.cuda.get_device_name(device) if on_gpu else f"a GPU of {mem:g} GiB"
    try:
        plan = pick(args, pins, cfg, box, card, "allocator: as set", free_layout=True, on_gpu=on_gpu, gpus=world)
    except MemoryError as e:
        fail(str(e))
    chosen = plan.settings()
    return replace(args, **chosen), pins | set(chosen), []


def gpus_to_plan(args: Any, pins: frozenset[str], found: int) -> tuple[int, bool]:
    """Over how many GPUs a run on a machine of ``found`` plans its layout, and whether that count was given
    (``--gpus N``: taken whole) or found (the plan takes as many as its fastest does). 1, nothing planned: a layout
    flag given (--dp, --zero, --tp, --pp, --plan; a resumed run's are its checkpoint's), one GPU, ``--gpus 1``."""
    given = args.gpus > 0  # this command line's (a resume keeps no --gpus)
    if pins & LAYOUT:
        layout = args.dp * args.tp * args.pp
        if given and args.gpus != layout:
            fail(f"--gpus {args.gpus} but --dp {args.dp} x --tp {args.tp} x --pp {args.pp} = {layout} ranks; leave "
                 f"one out (--gpus alone plans the layout over its GPUs)")
        return 1, given
    if given and not 1 <= args.gpus <= found:
        fail(f"--gpus {args.gpus}: this machine has {found} CUDA GPU{'s' if found > 1 else ''}; pass --gpus "
             f"{found} or fewer")
    return (args.gpus, True) if given else (found, False)


def visible_gpus(args: Any, device: torch.device) -> int:
    """The GPUs this launcher may plan over: the visible CUDA GPUs, or 1 on a GPU named by its index (``--gpus``
    still counts them) and on the CPU (where ``--gpus`` above 1 is refused: it plans GPUs)."""
    if device.type != "cuda":
        if args.gpus > 1:
            fail(f"--gpus {args.gpus} plans over CUDA GPUs, but this run is on {device}; --dp {args.gpus} starts "
                 f"{args.gpus} processes here (--plan auto --gpus {args.gpus} plans their layout)")
        return 1
    return torch.cuda.device_count() if device.index is None or args.gpus else 1


def check_layout(args: Any, cfg: Any, given: set[str], resumed: bool) -> Any:
    """Refuse (ValueError, one line) what the run's layout cannot do, before anything loads or any process
    starts; a run without --tp/--pp gets the data-parallel checks. ``resumed``: the batch is the checkpoint's.
    Returns the settings with a 3D run's default micro-batch in place."""
    if not composed(args):
        unused = [flag for dest, flag in LAYOUT_ONLY.items() if dest in given]
        if unused and args.plan != "auto":
            raise ValueError(f"{unused[0]} shapes a tensor- or pipeline-parallel layout; add --tp or --pp above 1, "
                             f"or leave it out")
        if args.hold_weights and ("zero" in given and args.zero != 3 or "dp" in given and args.dp == 1):
            raise ValueError(f"--hold-weights holds ZeRO-3's gathered weights; pass --dp N --zero 3 with it (not "
                             f"--dp {args.dp} --zero {args.zero}), or leave it out")
        dp.check_dp_args(args, resumed)
        return args
    refused = {"--stream": (args.stream, "each stage's weights stay on its GPUs"),
               "--hold-weights": (args.hold_weights, "ZeRO-3's, which the 3D trainer does not build"),
               "--compile with --sublayers": (args.compile and args.sublayers, "whole blocks are compiled"),
               "--zero 3": (args.zero == 3, "not built for the 3D trainer; use --zero 0, 1 or 2"),
               f"--recompute {args.recompute}": (args.recompute not in ("every", "none"),
                                                 "whole blocks or nothing: every or none")}
    for flag, (asked, why) in refused.items():
        if asked:
            raise ValueError(f"{flag} does not combine with --tp/--pp ({why}); leave it out, or train without them")
    if args.zero and args.dp == 1:
        raise ValueError(f"--zero {args.zero} shards over data-parallel ranks; pass --dp N with N > 1")
    launched = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else grid(args).size
    if launched != grid(args).size:
        raise ValueError(f"--tp {args.tp} x --pp {args.pp} x --dp {args.dp} = {grid(args).size} ranks, but torchrun "
                         f"started {launched} processes; make the product {launched} or launch {grid(args).size}")
    if resumed and args.batch % (args.dp * (args.micro_batch or 1)):
        dp.check_resumed_split(args)  # names the --dp that split the run's batch
    rows = args.batch // args.dp
    if args.batch % args.dp or args.micro_batch is not None and rows % args.micro_batch:
        raise ValueError(f"--batch {args.batch} does not split into --dp {args.dp} replicas of micro-batches of "
                         f"{args.micro_batch}; use a multiple of {args.dp * (args.micro_batch or 1)}")
    if args.micro_batch is None:  # the most that divide a replica's rows, up to 4 per pipeline rank (on a GPU, planned)
        counts = [m for m in range(1, min(rows, 4 * args.pp) + 1) if rows % m == 0] if args.pp > 1 else [1]
        args = replace(args, micro_batch=rows // max([m for m in counts if m % args.pp == 0] or counts))
    check_model(args, cfg)
    return args


def check_model(args: argparse.Namespace, cfg: Any) -> None:
    """The schedule, the cut into stages and the tensor-parallel cut of this model."""
    from nanotrain.pipeline import build_schedule
    from nanotrain.tensor_parallel.shard import axis_ranges
    spec = model_spec(cfg)
    if spec.dropout.any and args.pp > 1:  # --tp alone draws one process's masks (tested); pipelines are not tested
        where = f"{args.model}/config.json" if Path(args.model).is_dir() else "its config.json"
        raise ValueError(f"{args.model} has dropout ({spec.dropout}), which --pp {args.pp} does not train as one "
                         f"process would; set {', '.join(family_of(cfg).hf.dropout_keys)} to 0 in {where}, or train "
                         f"without --pp (--tp alone trains dropout exactly)")
    try:
        stages = build_schedule(args.schedule, args.pp, micro_batches(args), args.virtual_stages).n_stages
        axis_ranges(spec, args.tp, 0)
    except ValueError as e:
        raise ValueError(f"--pp {args.pp} --schedule {args.schedule} with {micro_batches(args)} micro-batches of "
                         f"{args.micro_batch} per replica, --tp {args.tp}: {e}") from None
    layers = spec.n_layer * (2 if args.sublayers else 1)
    if layers < stages:
        raise ValueError(f"{args.model} has {layers} layers to split but --pp {args.pp} with {args.schedule} makes "
                         f"{stages} stages; pass --n-layer {stages} (or more), fewer --pp, or another schedule")
    if args.sp and (args.micro_batch * args.seq) % args.tp:
        raise ValueError(f"--sp splits a micro-batch's {args.micro_batch} x {args.seq} tokens over --tp {args.tp}; "
                         f"make --micro-batch x --seq a multiple of {args.tp}")
    held = args.clip_norm is not None or args.dtype == "fp16"  # the whole model's norm: compose.trainer
    if held and args.zero and args.tp > spec.heads[1]:
        raise ValueError(f"--clip-norm or --dtype fp16 with --zero {args.zero} counts each key/value head's gradient "
                         f"once, which a shard of a head shared by several of --tp {args.tp} ranks does not tell "
                         f"({args.model} has {spec.heads[1]} key/value heads): use --zero 0, or --tp {spec.heads[1]} "
                         f"or less")
    if args.tp_overlap and args.schedule == "zb-h1":
        raise ValueError("--tp-overlap computes weight gradients in its own backward, which zb-h1 defers to its W "
                         "pass; leave one out")


def trainer(args: argparse.Namespace, cfg: Any, ctx: DistContext, weights: Leaves | None, dtype: torch.dtype,
            ocfg: OffloadConfig, adam: AdamConfig) -> Trainer:
    """This rank's share of the model, from the model's ``weights`` (each leaf cut as it is read) or (None)
    initialised by --seed,
    trained by nanotrain's AdamW through the data-parallel engine (``compose.Parallel3DTrainer``)."""
    from nanotrain.compose import Parallel3DTrainer, build_3d
    from nanotrain.pipeline import build_schedule
    from nanotrain.pipeline.layered import describe as describe_stages
    if args.gpu_mem_gib is not None:
        set_gpu_cap(args.gpu_mem_gib, ctx.device)
    schedule = build_schedule(args.schedule, args.pp, micro_batches(args), args.virtual_stages)
    p3d = build_3d(ctx, cfg, schedule, args.seq, args.micro_batch, args.sp, args.sublayers, args.recompute == "every",
                   seed=args.seed, dtype=dtype, weights=weights, overlap=args.tp_overlap,
                   compile="inductor" if args.compile else None)  # blocks compiled between the collectives
    print(describe_stages(p3d.pipe.specs), flush=True)
    return Parallel3DTrainer(p3d, adam, ocfg, dp.dp_config(args), clip_norm=args.clip_norm)


def describe(args: argparse.Namespace) -> str:
    """The run's layout, as the run's description line says it."""
    if not composed(args):
        return dp.describe(args)
    stage = stage_name(args.zero) if args.dp > 1 else ""
    extras = [args.schedule, "sequence parallel" if args.sp else "", "TP overlapped" if args.tp_overlap else "", stage]
    return (f" on tp {args.tp} x pp {args.pp} x dp {args.dp} ({args.grid_order}: "
            f"{', '.join(e for e in extras if e)})")
