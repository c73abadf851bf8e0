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
from pathlib import Path
from typing import Any, Callable

import torch

from nanotrain.run import toml_config
from nanotrain.run.cli import fail, given_dests, pick_device
from nanotrain.data_parallel import launch as dp
from nanotrain.distributed import close_distributed, init_distributed
from nanotrain.distributed.failure import RankFailure, RankLost
from nanotrain.core import recipe
from nanotrain.distributed.spawn import Stopped
from nanotrain.core.machine import use_expandable_segments
from nanotrain.core.leaves import Leaves
from nanotrain.core.models import model_spec
from nanotrain.monitor import JsonlSink, NvmlSampler, StdoutSink
from nanotrain.monitor.profile import StepProfiler, parse_steps
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.run import compose, lora
from nanotrain.run.export import exporting
from nanotrain.run.flags import check_args, eager_under_dropout, freeze, parse_args, parser, pinned
from nanotrain.run.folder import (after_failed_save, check_model, dashboard, plot_run, prepare_resume,
                                  resumed_schedule, saved_settings, start_disk, vars_json)
from nanotrain.run.lock import run_folder
from nanotrain.run.start import starting_leaves
from nanotrain.run.inputs import check_data, check_weights, load_data, resolve_model, validation_batches
from nanotrain.plan.run import exact_skip, plan_run, staged_units, train_config
from nanotrain.plan.plan import Plan
from nanotrain.tokenizer import TokenizerError
from nanotrain.core.train import loop
from nanotrain.checkpoint.disk import SaveFailed
from nanotrain.core.train.evaluate import Evaluator
from nanotrain.core.train.health import TrainingStopped
from nanotrain.core.train.preempt import StopRequest, exit_by
from nanotrain.checkpoint.run_dir import Found
from nanotrain.core.train.schedule import LRSchedule, schedule_from_args
from nanotrain.checkpoint.background import Saver
from nanotrain.checkpoint.resume import check_resumable, restore, saved_schedule
from weights import CheckpointError


def main(argv: list[str] | None = None) -> None:
    # SIGTERM and Ctrl-C are caught from the start: during training they stop it at the step boundary,
    # saved; before it (loading, checking) they stop it before the first step (nanotrain.core.train.preempt).
    allocator = use_expandable_segments()  # before CUDA allocates: local data-parallel ranks inherit it
    with StopRequest() as stop:
        try:
            train(argv, stop, allocator)
        except Stopped as e:  # the ranks started here stopped by a signal, saved: end as they did
            exit_by(e.signal)
        stop.exit_if_stopped()  # by the signal, not 0, once the run folder is released: the run is not done


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
    plan: Plan


def train(argv: list[str] | None, stop: StopRequest, allocator: tuple[bool, str]) -> None:
    parsed = parse_args(argv)
    dp.resume_after_restart(parsed)
    speak = dp.mute_other_ranks()
    with run_folder(parsed.out):  # one run per folder, released at any exit
        checked_run(parsed, argv, stop, allocator, speak)


def checked_run(parsed: argparse.Namespace, argv: list[str] | None, stop: StopRequest, allocator: tuple[bool, str],
                speak: Callable[[], None]) -> None:
    given = given_dests(parser(), argv)
    found = prepare_resume(parsed, given)  # every saved setting back in place before any is checked
    ckpt = found and found.path
    pins = pinned(parsed, given, saved_settings(ckpt) if ckpt else {})
    args = freeze(parsed)  # from here on the settings are a value, replaced (never written) by what is planned
    model = resolve_model(args)
    args = eager_under_dropout(args, pins, model.cfg)
    # the layout planned (--plan auto, or no layout flag on several GPUs); the ranks started here get its flags
    args, pins, planned = compose.plan_layout(args, pins, model.cfg, pick_device(args.device), allocator[0])
    try:
        args = compose.check_layout(args, model.cfg, given, resumed=ckpt is not None and "batch" not in given)
    except ValueError as e:
        fail(str(e))
    check_args(args, pins, model.cfg, pick_device(args.device))  # here, before local processes start
    if ckpt is None:
        check_weights(args, model)
    start = checked_start(args, model, ckpt)
    if start >= args.steps:
        print(f"nothing to do: {ckpt} is at step {start} and --steps {args.steps} is the run's total; raise "
              f"--steps to train further", flush=True)
        return
    if stop.signal is not None:  # signalled while checking: nothing has started
        print(f"stopped by {stop.name} before training started", flush=True)
        return
    if dp.started_here(compose.grid(args), main, [*(sys.argv[1:] if argv is None else argv), *planned]):
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
        if ckpt is None:
            return 0
        check_model(ckpt, model.cfg, args.model, saved_settings(ckpt).get("model"))
        # any layout resumes it; 8-bit moments only at their tensor-parallel cut
        cut = (args.tp, OffloadConfig().block if args.adam_bits == 8 else None) if compose.composed(args) else ()
        check_resumable(ckpt, *cut)
    except CheckpointError as e:
        fail(str(e))
    return int(json.loads((ckpt / "trainer.json").read_text())["step"])


def build(args: Any, pins: frozenset[str], model: Any, found: Found | None, start: int, ctx: Any,
          device: torch.device, allocator: tuple[bool, str]) -> Built:
    """Data, plan, weights and the trainer, resumed when there is a checkpoint; a bad input is one line."""
    cfg, ckpt = model.cfg, found and found.path
    trained = lora.model(args, cfg)  # with --lora-rank the adapted spec: the base frozen (in NF4 with base bits 4)
    dtype = recipe.compute_dtype(args.dtype, device)
    try:
        data, val_data = load_data(args, model)
        loader = data.loader(args.seq, args.batch, seed=args.seed, pack=args.pack)  # a corpus too short fails here
        print(f"data: {args.data}: {loader.describe()}", flush=True)
        fingerprint = data.fingerprint()
        if ckpt is not None:
            check_data(ckpt, fingerprint, args.allow_changes)
        plan = plan_run(args, pins, trained, device, allocator, ctx)  # refuses a plan that cannot fit, before loading
        asked_micro = args.micro_batch  # the plan's depends on the world size: a resume at another --dp plans its own
        args = replace(args, **plan.settings())
        tcfg = None  # a 3D run's layout was checked with its flags (nanotrain.run.compose)
        if not compose.composed(args):
            tcfg = train_config(args, plan)  # bad settings fail here, before the weights load
            dp.check_split(args.batch, plan.micro_batch, args.dp)
        if ctx is None or ctx.rank == 0:
            start_disk(args, start, found.corrupt if found else ())
            toml_config.write_config(args, args.out / "config.toml")
        schedule = schedule_from_args(args) if ckpt is None else resumed_schedule(args, saved_schedule(ckpt), start)
    except (TokenizerError, CheckpointError, FileNotFoundError, ValueError, MemoryError) as e:
        fail(str(e))
    ocfg = recipe.offload_config(trained, device, dtype, args.states, args.adam_bits,
                                 staged_units=staged_units(trained, plan), base_bits=args.lora_base_bits,
                                 exact_skip=exact_skip(args) and plan.engine != "streamed")
    adam = AdamConfig(lr=args.lr, weight_decay=args.weight_decay)
    try:  # the weights are read as the trainer takes them: a damaged file fails here
        with starting_leaves(args, model, ckpt, dtype, device) as leaves:
            trainer = engine_trainer(args, plan, trained, ctx, leaves, tcfg, dtype, ocfg, adam)
    except (CheckpointError, FileNotFoundError, ValueError, MemoryError) as e:
        fail(str(e))
    if ckpt is not None:
        try:
            loader.position = restore(trainer, ckpt)  # this rank's pieces, from whichever layout saved them
        except CheckpointError as e:  # e.g. 8-bit moments saved sharded, resumed at another --dp
            trainer.close()
            fail(str(e))
        print(f"resumed from {ckpt} at step {trainer.step_count}", flush=True)
    meta = vars_json(replace(args, micro_batch=asked_micro)) | {"data_fingerprint": fingerprint.to_json()}
    return Built(args, trainer, loader, val_data, schedule, plan.micro_batch, dtype, meta, plan)


def engine_trainer(args: Any, plan: Any, trained: Any, ctx: Any, leaves: Leaves | None, tcfg: Any, dtype: torch.dtype,
                   ocfg: OffloadConfig, adam: AdamConfig) -> Any:
    """The planned engine's trainer: each takes the leaves as they come (a unit or a leaf at a time; a data-parallel
    or 3D rank keeps its share of each)."""
    if compose.composed(args):
        return compose.trainer(args, trained, ctx, leaves, dtype, ocfg, adam)
    if plan.engine == "streamed":  # engines imported where chosen: a run loads none it does not run
        if ctx:
            from nanotrain.stream.zero_offload import zero_offload_trainer
            return zero_offload_trainer(trained, leaves, tcfg, adam, ocfg, dp.dp_config(args), ctx.grid.dp_group)
        from nanotrain.stream.trainer import StreamTrainer
        return StreamTrainer(trained, leaves, tcfg, adam, ocfg)
    if ctx is None:
        return recipe.build(trained, leaves, tcfg, adam, ocfg)
    from nanotrain.data_parallel.trainer import data_parallel_trainer
    return data_parallel_trainer(trained, leaves, tcfg, adam, ocfg, dp.dp_config(args), ctx.grid.dp_group)


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
    lcfg = recipe.loop_config(lora.model(args, cfg), device, args.steps, args.batch, args.seq,  # LoRA: its FLOPs
                              gpus=compose.grid(args).size, save_every=args.save_every, host_mem_gib=args.host_mem_gib,
                              schedule=b.schedule, max_skipped_steps=args.max_skipped_steps)
    first = ctx is None or ctx.rank == 0
    sinks = [StdoutSink(), JsonlSink(args.out / "metrics.jsonl")] + dashboard(args, trainer.step_count) if first else []
    profiler = None if args.profile_steps is None else StepProfiler(*parse_steps(args.profile_steps),
                                                                     args.out / "profile", device,
                                                                     rank=ctx.rank if ctx else 0,  # a trace each
                                                                     done_steps=trainer.step_count)
    hooks = [h for h in (NvmlSampler.start(device), evaluator, profiler) if h is not None]
    saver = Saver(args.out, args.keep_last, args.host_mem_gib)  # each rank its shard, on a thread beside training

    def save() -> Path:
        path = saver.save(trainer, loader.position, b.meta, b.schedule)
        if trainer.step_count >= args.steps or stop.signal is not None:
            saver.wait()  # the run's last save is on disk before it ends
        return path

    save = exporting(args, save, lambda: trainer.step_count, first, saver.wait)  # --export, --export-every
    records = []
    phase = (lambda what: setattr(ctx, "where", what)) if ctx else (lambda _: None)  # named if a rank fails
    try:
        with ctx.guard() if ctx else contextlib.nullcontext():  # a failing rank stops all, named
            records = loop.run(trainer, (lambda: fixed) if fixed is not None else loader.next_batch, lcfg, sinks,
                               device, save=None if args.no_save else save, hooks=hooks, stop=stop, phase=phase)
            saver.wait()
    except (loop.HostMemoryExceeded, TrainingStopped) as e:
        trainer.close()
        halve = " or use --adam-bits 8" if isinstance(e, loop.HostMemoryExceeded) and args.adam_bits == 32 else ""
        sys.exit(f"error: {e}{halve}")
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
        if told := b.plan.against(records):
            print(told, flush=True)
    if stop.signal is not None and trainer.step_count < args.steps:
        if args.no_save:
            print(f"stopped by {stop.name} at step {trainer.step_count} of {args.steps}, not saved (--no-save)",
                  flush=True)
        elif records:
            again = list(sys.argv[1:] if argv is None else argv) + ([] if args.resume else ["--resume"])
            print(f"stopped by {stop.name} at step {trainer.step_count} of {args.steps}, saved in {args.out}; "
                  f"continue with:\n  python -m tasks.finetune {shlex.join(again)}", flush=True)


def describe(args: argparse.Namespace, cfg: Any, b: Built, device: torch.device) -> str:
    mode = "weights streamed block by block" if args.stream else f"recompute {args.recompute}" + (
        " (ZeRO-3 gathers each unit's weights again for its backward)" if args.zero == 3 and not args.hold_weights
        else "")
    if args.lora_rank:
        mode += (f", LoRA rank {args.lora_rank} on {','.join(lora.config(args, cfg).targets)} (the base frozen"
                 f"{', its matrices in NF4' if args.lora_base_bits == 4 else ''})")
    states = "in host memory, updated on the device" if args.stream else f"on {args.states}"
    return (f"{args.model}: {model_spec(cfg).costs.total_params / 1e6:.0f}M parameters, batch {args.batch} x "
            f"{args.seq} as {args.batch // b.micro} micro-batches of {b.micro}{compose.describe(args)}, {mode}, "
            f"{args.adam_bits}-bit Adam states {states}, {b.dtype} compute on {device}; {b.schedule.describe()}")
