"""A fine-tuning run from its flags: resume, check, plan, load, build the trainer, run the one loop.

``main`` is what ``python -m tasks.finetune`` runs (the task holds only its docstring). The order matters:
a resume puts the saved run's settings back before any setting is checked; every check and plan that can
refuse the run does so before local data-parallel processes start or weights load; the ranks that do start
run ``main`` again, as torchrun would.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch

from nanotrain.run import toml_config
from nanotrain.run.cli import fail, given_dests, pick_device, warn_nonfinite
from nanotrain.checkpoint import sharded
from nanotrain.data_parallel import launch as dp
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.distributed import close_distributed, init_distributed
from nanotrain.distributed.failure import RankFailure, RankLost
from nanotrain.core.flops import flops_per_token, peak_flops
from nanotrain.core.footprint import use_expandable_segments
from nanotrain.core.models import model_spec, run
from nanotrain.monitor import JsonlSink, NvmlSampler, StdoutSink
from nanotrain.monitor.profile import StepProfiler, parse_steps
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.run import compose
from nanotrain.run.flags import check_args, freeze, parse_args, parser, pinned
from nanotrain.run.folder import (after_failed_save, check_model, dashboard, plot_run, prepare_resume,
                                  resumed_schedule, saved_settings, start_disk, vars_json)
from nanotrain.run.inputs import check_data, load_data, resolve_model, validation_batches
from nanotrain.plan.run import exact_skip, plan_run, staged_units, train_config
from nanotrain.tokenizer import TokenizerError
from nanotrain.core.train import loop
from nanotrain.checkpoint.disk import SaveFailed, check_writable
from nanotrain.core.train.evaluate import Evaluator
from nanotrain.core.train.health import TrainingStopped
from nanotrain.core.train.preempt import StopRequest
from nanotrain.core.train.resident import ResidentTrainer
from nanotrain.checkpoint.run_dir import Found
from nanotrain.core.train.schedule import LRSchedule, schedule_from_args
from nanotrain.checkpoint.state import load_masters, restore, save_checkpoint, saved_schedule
from nanotrain.stream.trainer import StreamTrainer
from weights import CheckpointError, load_weights


def main(argv: list[str] | None = None) -> None:
    # SIGTERM and Ctrl-C are caught from the start: during training they stop it at the step boundary,
    # saved; before it (loading, checking) they stop it before the first step (nanotrain.core.train.preempt).
    allocator = use_expandable_segments()  # before CUDA allocates: local data-parallel ranks inherit it
    with StopRequest() as stop:
        train(argv, stop, allocator)


@dataclass
class Built:
    """What the loop needs, once everything that can refuse the run has been checked."""
    args: Any  # the run's settings, the plan's in place
    trainer: Any
    loader: Any
    val_data: Any
    schedule: LRSchedule
    micro: int
    dtype: torch.dtype
    meta: dict


def train(argv: list[str] | None, stop: StopRequest, allocator: tuple[bool, str]) -> None:
    parsed = parse_args(argv)
    dp.resume_after_restart(parsed)
    speak = dp.mute_other_ranks()
    given = given_dests(parser(), argv)
    found = prepare_resume(parsed, given)  # every saved setting back in place before any is checked
    ckpt = found and found.path
    pins = pinned(parsed, given, saved_settings(ckpt) if ckpt else {})
    args = freeze(parsed)  # from here on the settings are a value, replaced (never written) by what is planned
    model = resolve_model(args)
    args, pins = compose.plan_layout(args, pins, model.cfg, pick_device(args.device))  # --plan auto: the layout
    try:
        args = compose.check_layout(args, model.cfg, given, resumed=ckpt is not None and "batch" not in given)
    except ValueError as e:
        fail(str(e))
    check_args(args, pins, model.cfg, pick_device(args.device))  # here, before local processes start
    start = checked_start(args, model, ckpt)
    if start >= args.steps:
        print(f"nothing to do: {ckpt} is at step {start} and --steps {args.steps} is the run's total; raise "
              f"--steps to train further", flush=True)
        return
    if stop.signal is not None:  # signalled while checking: nothing has started
        print(f"stopped by {stop.name} before training started", flush=True)
        stop.exit_if_stopped()
    if dp.started_here(compose.grid(args), main, argv):
        return
    grid = compose.grid(args)
    ctx = None if grid.size == 1 else init_distributed(grid)  # launched by torchrun or started here
    speak()
    device = ctx.device if ctx else pick_device(args.device)
    if device.type == "cuda" and device.index is None:  # some CUDA calls want the index spelled out
        device = torch.device("cuda", torch.cuda.current_device())
    built = build(args, pins, model, found, start, ctx, device, allocator)
    fit(built.args, argv, model.cfg, built, ctx, device, stop)


def checked_start(args: argparse.Namespace, model: Any, ckpt: Any) -> int:
    """The step the run starts from, after checking the checkpoint holds this model at a layout it resumes at."""
    try:
        check_writable(args.out)
        if ckpt is None:
            return 0
        check_model(ckpt, model.cfg, args.model, saved_settings(ckpt).get("model"))
        if sharded.is_sharded(ckpt):  # any world size resumes it; 8-bit moments only at their tensor-parallel cut
            cut = (args.tp, OffloadConfig().block if args.adam_bits == 8 else None) if compose.composed(args) else ()
            sharded.check_resumable(ckpt, *cut)
        elif compose.composed(args):
            fail(f"{ckpt} holds one process's whole state, which --tp/--pp runs do not resume: resume it without "
                 f"them, or start from its weights with --weights {ckpt}")
    except CheckpointError as e:
        fail(str(e))
    return int(json.loads((ckpt / "trainer.json").read_text())["step"])


def build(args: Any, pins: frozenset[str], model: Any, found: Found | None, start: int, ctx: Any,
          device: torch.device, allocator: tuple[bool, str]) -> Built:
    """Data, plan, weights and the trainer, resumed when there is a checkpoint; a bad input is one line."""
    cfg, ckpt = model.cfg, found and found.path
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        data, val_data = load_data(args, model)
        loader = data.loader(args.seq, args.batch, seed=args.seed)  # a corpus too short fails here
        print(f"data: {args.data}: {loader.describe()}", flush=True)
        fingerprint = data.fingerprint()
        if ckpt is not None:
            check_data(ckpt, fingerprint, args.allow_changes)
        plan = plan_run(args, pins, cfg, device, allocator, ctx)  # refuses a plan that cannot fit, before loading
        asked_micro = args.micro_batch  # the plan's depends on the world size: a resume at another --dp plans its own
        args = replace(args, **plan.settings(),  # ZeRO's 8-bit moments resume from sharded saves only
                       sharded_save=args.sharded_save or plan.zero > 0 and args.adam_bits == 8)
        if not compose.composed(args):  # a 3D run's layout was checked with its flags (nanotrain.run.compose)
            tcfg = train_config(args, plan)  # bad settings fail here, before the weights load
            dp.check_split(args.batch, plan.micro_batch, args.dp)
        if ctx is None or ctx.rank == 0:
            start_disk(args, start, found.corrupt if found else ())
            toml_config.write_config(args, args.out / "config.toml")
        schedule = schedule_from_args(args) if ckpt is None else resumed_schedule(args, saved_schedule(ckpt), start)
        params = initial_params(args, model, ckpt, dtype)
    except (TokenizerError, CheckpointError, FileNotFoundError, ValueError, MemoryError) as e:
        fail(str(e))
    if params is not None:
        warn_nonfinite(params, ckpt or args.weights)
    ocfg = OffloadConfig(device=str(device), dtype=dtype, offload=args.states == "cpu", state_bits=args.adam_bits,
                         keep_32bit=model_spec(cfg).fp32_moments, staged_units=staged_units(cfg, plan),
                         exact_skip=exact_skip(args) and plan.engine != "streamed")
    adam = AdamConfig(lr=args.lr, weight_decay=args.weight_decay)
    try:
        if compose.composed(args):
            trainer = compose.trainer(args, cfg, ctx, params, dtype, ocfg, adam)
        elif ctx:
            trainer = data_parallel_trainer(cfg, params, tcfg, adam, ocfg, dp.dp_config(args), ctx.grid.dp_group)
        else:
            trainer = (StreamTrainer if plan.engine == "streamed" else ResidentTrainer)(cfg, params, tcfg, adam, ocfg)
    except (ValueError, MemoryError) as e:
        fail(str(e))
    del params
    if ckpt is not None:
        try:
            pieces = sharded.restore_sharded if ctx else sharded.restore_whole  # a rank's pieces, or every leaf
            loader.position = (pieces if sharded.is_sharded(ckpt) else restore)(trainer, ckpt)
        except CheckpointError as e:  # e.g. 8-bit moments saved sharded, resumed at another --dp
            trainer.close()
            fail(str(e))
        print(f"resumed from {ckpt} at step {trainer.step_count}", flush=True)
    meta = vars_json(replace(args, micro_batch=asked_micro)) | {"data_fingerprint": fingerprint.to_json()}
    return Built(args, trainer, loader, val_data, schedule, plan.micro_batch, dtype, meta)


def initial_params(args: argparse.Namespace, model: Any, ckpt: Any, dtype: torch.dtype) -> Any:
    """What the trainer starts from: the checkpoint's masters, or the --weights. None for a 3D run that resumes or
    starts from random weights: each rank restores, or initialises by --seed, its own share."""
    if compose.composed(args) and (ckpt is not None or args.weights == "random"):
        return None
    if ckpt is not None:  # its fp32 masters, in either format
        masters = (sharded.load_masters if sharded.is_sharded(ckpt) else load_masters)(ckpt)
        return run.tree_from(model_spec(model.cfg), masters.items())
    # a random model is written once in the compute dtype (16 GB, not 32, for an 8B model), widened as it loads
    return load_weights(model.cfg, model.weights(args.weights), seed=args.seed, random_dtype=dtype)


def fit(args: argparse.Namespace, argv: list[str] | None, cfg: Any, b: Built, ctx: Any, device: torch.device,
        stop: StopRequest) -> None:
    """The one loop over the built trainer, with its sinks, hooks and saves; how the run ends, said in one line."""
    trainer, loader = b.trainer, b.loader
    fixed = loader.next_batch() if args.fixed_batch else None
    try:
        evaluator = None if b.val_data is None else Evaluator(trainer, validation_batches(b.val_data, args),
                                                                args.eval_every, args.steps)
    except ValueError as e:
        trainer.close()
        sys.exit(f"error: {e}")
    print(describe(args, cfg, b, device), flush=True)
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    lcfg = loop.LoopConfig(steps=args.steps, sequences_per_step=args.batch, seq_len=args.seq,
                           flops_per_token=flops_per_token(cfg, args.seq),
                           peak_flops=peak and peak * compose.grid(args).size,  # every rank's GPU works on it
                           save_every=args.save_every, host_mem_gib=args.host_mem_gib, schedule=b.schedule,
                           max_skipped_steps=args.max_skipped_steps)
    first = ctx is None or ctx.rank == 0
    sinks = [StdoutSink(), JsonlSink(args.out / "metrics.jsonl")] + dashboard(args, trainer.step_count) if first else []
    profiler = None if args.profile_steps is None else StepProfiler(*parse_steps(args.profile_steps),
                                                                     args.out / "profile", device,
                                                                     rank=ctx.rank if ctx else 0,  # a trace each
                                                                     done_steps=trainer.step_count)
    hooks = [h for h in (NvmlSampler.start(device), evaluator, profiler) if h is not None]
    each = args.sharded_save or compose.composed(args)  # every rank writes its own shard
    writer = sharded.save_sharded if each else save_checkpoint
    save = lambda: writer(args.out, trainer, loader.position, b.meta, b.schedule, keep_last=args.keep_last)  # noqa: E731
    if not (each or first):  # the others help gather the state that the first saves
        save = lambda: (trainer.state_dict(), None)[1]  # noqa: E731
    records = []
    phase = (lambda what: setattr(ctx, "where", what)) if ctx else (lambda _: None)  # named if a rank fails
    try:
        with ctx.guard() if ctx else contextlib.nullcontext():  # a failing rank stops all, named
            records = loop.run(trainer, (lambda: fixed) if fixed is not None else loader.next_batch, lcfg, sinks,
                               device, save=None if args.no_save else save, hooks=hooks, stop=stop, phase=phase)
    except (loop.HostMemoryExceeded, TrainingStopped) as e:
        trainer.close()
        sys.exit(f"error: {e}")
    except RankLost as e:  # a peer killed or hung: the message says it all, this rank's traceback nothing
        sys.exit(f"error: {e}")
    except (SaveFailed, RankFailure) as e:
        if isinstance(e, RankFailure) and not isinstance(e.__cause__, SaveFailed):
            raise
        trainer.close()
        sys.exit(f"error: {e}\n{after_failed_save(args)}")
    finally:
        for closing in sinks + [h for h in hooks if h is not evaluator]:
            closing.close()
    trainer.close()
    if ctx:
        close_distributed(ctx)
    if records and first:
        plot_run(args)
    if stop.signal is not None and trainer.step_count < args.steps:
        if args.no_save:
            print(f"stopped by {stop.name} at step {trainer.step_count} of {args.steps}, not saved (--no-save)",
                  flush=True)
        elif records:
            again = list(sys.argv[1:] if argv is None else argv) + ([] if args.resume else ["--resume"])
            print(f"stopped by {stop.name} at step {trainer.step_count} of {args.steps}, saved in {args.out}; "
                  f"continue with:\n  python -m tasks.finetune {shlex.join(again)}", flush=True)
        stop.exit_if_stopped()  # by the signal, not 0: the run is not done (nanotrain.core.train.preempt)


def describe(args: argparse.Namespace, cfg: Any, b: Built, device: torch.device) -> str:
    mode = "weights streamed block by block" if args.stream else f"recompute {args.recompute}"
    states = "in host memory, updated on the device" if args.stream else f"on {args.states}"
    return (f"{args.model}: {model_spec(cfg).costs.total_params / 1e6:.0f}M parameters, batch {args.batch} x "
            f"{args.seq} as {args.batch // b.micro} micro-batches of {b.micro}{compose.describe(args)}, {mode}, "
            f"{args.adam_bits}-bit Adam states {states}, {b.dtype} compute on {device}; {b.schedule.describe()}")
