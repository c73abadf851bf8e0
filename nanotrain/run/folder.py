"""The run folder: what a resume takes from it (the newest intact checkpoint, its model, its run's settings, its
lr schedule), what a starting run cleans in it, and what a run leaves there besides checkpoints (the dashboard,
the loss curve, the saved flags).

A checkpoint keeps the model's ``config.json`` and, in ``trainer.json``, the settings of the run that saved it. A
resume takes every setting it is not given again from there (so an omitted ``--lr`` is the run's, not the
default), says which given ones differ, and refuses those that would make the resumed run differ from the
uninterrupted one unless asked to allow them.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from nanotrain.run.cli import fail
from nanotrain.core.models import model_spec
from nanotrain.monitor import TensorBoardSink, cut_jsonl, read_jsonl, tensorboard_available
from nanotrain.monitor.plot import plot_curves
from nanotrain.checkpoint.run_dir import Found, find_checkpoint, named_by_latest, remove_stale, set_aside, step_folders
from nanotrain.core.train.schedule import LRSchedule, schedule_from_args
from weights import CheckpointError, read_config


# How a resume treats each saved setting (by argparse ``dest``): KEPT ones are never restored (where and how this
# process runs; --sharded-save, which does nothing: every save is sharded), QUIET ones are restored and their
# changes expected (the total step count), a change to an EXACT one makes the run differ (refused unless
# allowed), FIXED ones the checkpoint cannot load with another value.
# Any other (--dp, --zero, --micro-batch, --recompute, --stream, --tp, --pp, --schedule, --sp, ...:
# those change the sums' order, not the sums) is restored, changes warned. 8-bit moments saved at another tp are
# refused with the checkpoint. --plan auto and its inputs are this process's own: the run saved the layout it
# picked. All of it happens before any setting is checked.
KEPT = frozenset({"resume", "out", "device", "tokenizer_dir", "weights", "gpu_mem_gib", "host_mem_gib", "allow_changes",
                  "config", "profile_steps", "tensorboard", "plan", "gpus", "flops", "tp_gbps", "link_gbps",
                  "layer_overhead_ms", "sharded_save"})
QUIET = frozenset({"steps", "save_every", "no_save", "keep_last", "max_skipped_steps", "eval_every", "eval_batches",
                   "clip_overlap", "dp_check"})
EXACT = frozenset({"batch", "seq", "lr", "weight_decay", "data", "data_dtype", "seed", "fixed_batch", "clip_norm",
                   "lr_schedule", "warmup_steps", "decay_steps", "min_lr", "dp_reduce_dtype", "pack", "lora_alpha",
                   "lora_dropout", "lora_base_bits"})
FIXED = frozenset({"model", "n_layer", "adam_bits", "lora_rank", "lora_targets"})  # LoRA's: the pairs' shapes
BEFORE = {"pack": False}  # what a checkpoint saved before a setting existed ran with (chat data was padded then)


def prepare_resume(args: argparse.Namespace, given: set[str]) -> Found | None:
    """With --resume: the checkpoint (the newest whose files match their checksums), the saved run's
    settings put back into ``args`` for those not ``given`` on the command line (changes said or refused).
    Without: None, after refusing a folder that holds another run. Reads, never writes."""
    if not args.resume:
        if (args.out / "latest").exists() or step_folders(args.out):
            fail(f"{args.out} holds a run's checkpoints; pass --resume to continue it, or another --out to start a "
                 f"new one")
        return None
    try:
        found = find_checkpoint(args.out)
        saved = saved_settings(found.path)
        for line in restore_settings(vars(args), given, saved, args.allow_changes):
            print(line, flush=True)
    except (CheckpointError, ValueError) as e:
        fail(str(e))
    if found.note:
        print(f"warning: {found.note}", flush=True)
    return found


def saved_settings(ckpt: Path) -> dict:
    """The settings of the run that saved ``ckpt`` (empty for checkpoints that did not record them)."""
    return json.loads((ckpt / "trainer.json").read_text()).get("meta", {})


def check_model(ckpt: Path, cfg: Any, model: str, saved_model: str | None) -> None:
    """Refuse to resume ``ckpt`` as another model (other leaves, heads or context), naming both, before anything
    is built."""
    saved, ours = model_spec(read_config(ckpt)), model_spec(cfg)
    if (saved.shapes, saved.heads, saved.n_ctx) != (ours.shapes, ours.heads, ours.n_ctx):
        raise CheckpointError(f"{ckpt} is {saved_model or 'another model'} ({saved.n_layer} layers x "
                              f"{saved.costs.width} wide); you asked for {model} ({ours.n_layer} x "
                              f"{ours.costs.width}): pass --model {saved_model or '...'} or leave --model out to "
                              f"resume it")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def restore_settings(args: dict, given: set[str], saved: dict, allow_changes: bool) -> list[str]:
    """Set in ``args`` every saved setting not ``given`` on the command line (``KEPT`` ones aside);
    returns a warning per given setting that differs. Raises ``ValueError`` for a change to a
    ``FIXED`` setting, or to an ``EXACT`` one without ``allow_changes``."""
    warnings, refused = [], []
    for dest, old in (BEFORE | saved).items():
        if dest in KEPT or dest not in args:
            continue
        if dest not in given:
            args[dest] = old
            continue
        new = args[dest]
        if new == old or dest in QUIET:
            continue
        if dest in FIXED:
            raise ValueError(f"the checkpoint was saved with {_flag(dest)} {old} and cannot be resumed with "
                             f"{_flag(dest)} {new}; leave {_flag(dest)} out to take the checkpoint's")
        change = f"{_flag(dest)} {new} (the checkpoint's run had {old})"
        if dest in EXACT and not allow_changes:
            refused.append(change)
        else:
            warnings.append(f"warning: resuming with {change}")
    if refused:
        raise ValueError(f"resuming with {'; '.join(refused)} would not continue the run exactly; leave "
                         f"{'those' if len(refused) > 1 else 'it'} out to take the checkpoint's, or pass "
                         f"--allow-changes")
    return warnings


def after_failed_save(args: argparse.Namespace) -> str:
    """What a run whose save failed does now (it stops: every further step would be lost with the process)."""
    latest = named_by_latest(args.out)
    kept = f"its latest checkpoint, {latest}, is intact" if latest else "it had saved no checkpoint yet"
    return (f"the run stops here, as a run that cannot save would lose every further step; {kept}: free some "
            f"space in {args.out}, then continue with --resume")


def start_disk(args: argparse.Namespace, step: int, corrupt: tuple[Path, ...]) -> None:
    """The run folder as a run starting at ``step`` wants it: what killed saves left removed, checkpoints
    that failed their checksums set aside, the metrics past ``step`` (a resumed run writes them again) dropped."""
    args.out.mkdir(parents=True, exist_ok=True)
    for name in remove_stale(args.out):
        print(f"removed {args.out / name}, left by a save that was killed", flush=True)
    for moved in set_aside(corrupt):
        print(f"set aside {moved}: a file of it does not match its checksum (its other files are kept there; "
              f"delete it when you are done with it)", flush=True)
    dropped = cut_jsonl(args.out / "metrics.jsonl", step)
    if dropped:
        print(f"dropped {dropped} records past step {step} from {args.out / 'metrics.jsonl'}", flush=True)


def dashboard(args: argparse.Namespace, first_step: int) -> list:
    """The TensorBoard sink, unless turned off or not installed (then said once)."""
    if not args.tensorboard:
        return []
    if not tensorboard_available():
        print("note: no dashboard: pip install tensorboard (then: just dashboard OUT)", flush=True)
        return []
    return [TensorBoardSink(args.out, first_step)]


def resumed_schedule(args: argparse.Namespace, saved: LRSchedule | None, step: int) -> LRSchedule:
    """The resumed run's lr schedule: the saved run's, with the schedule settings changed on the command line
    (--lr, --lr-schedule, --warmup-steps, --decay-steps, --min-lr: refused without --allow-changes) applied.
    A longer --steps does not stretch a decay under way (the run stays exact): where it would end before the
    new total, one line says so and how to decay over the longer run instead."""
    derived = args.decay_steps is None  # "--steps": pinned where the saved run's decay ends
    pinned = argparse.Namespace(**{**vars(args), "decay_steps": saved.decay_steps}) if saved and derived else args
    schedule = schedule_from_args(pinned)
    if saved is not None and schedule != saved:
        print(f"lr schedule from step {step}: {schedule.describe()} (the run's was {saved.describe()})", flush=True)
    if schedule.kind != "constant" and derived and schedule.decay_steps < args.steps:
        stretched = LRSchedule(schedule.lr, schedule.kind, schedule.warmup_steps, args.steps, schedule.min_lr)
        first = max(step, schedule.decay_steps) + 1
        floor = f"steps {first}-{args.steps}" if args.steps > first else f"step {first}"
        print(f"note: the run's {schedule.kind} decay ends at step {schedule.decay_steps}, so {floor} train"
              f"{'s' if args.steps == first else ''} at its floor, lr {schedule.min_lr:g}; to decay "
              f"over the longer run instead, add --decay-steps {args.steps} --allow-changes (lr "
              f"{stretched.lr_at(step):.3g} at step {step}, then down to {schedule.min_lr:g} at step {args.steps})",
              flush=True)
    return schedule


def plot_run(args: argparse.Namespace) -> None:
    """The whole run's loss curve and its validation loss where measured, resumed segments included (the last
    record of each step wins)."""
    rows = read_jsonl(args.out / "metrics.jsonl")
    losses = [row["loss"] for row in rows if row["loss"] is not None]
    val = [(row["step"], row["val_loss"]) for row in rows if row.get("val_loss") is not None]
    if losses:
        plot_curves({f"{args.model} loss": losses}, args.out / "loss.png",
                    f"{args.model}: batch {args.batch} x {args.seq}, "
                    + ("weights streamed" if args.stream else f"recompute {args.recompute}"),
                    ylabel="loss", points={"validation loss": tuple(map(list, zip(*val)))} if val else None)


def vars_json(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
