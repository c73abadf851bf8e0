"""The one training loop: runs any ``Trainer``, one metrics record per step, handed to sinks.

It sets each step's learning rate from the schedule, times the step, builds the record (its fields:
``monitor.sinks``), enforces the host-memory guard, stops a run that keeps skipping steps and warns of a
loss blow-up (``train.health``), saves on a cadence and stops cleanly when pre-empted. Everything else a
run needs (what to train, where batches come from, how to save, what to evaluate) is passed in, so the
fine-tuning task, the pipeline and the tensor-parallel tasks and the Adam comparison all run this loop.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from nanotrain.core.machine import GIB, host_rss_gib
from nanotrain.monitor.sinks import Sink
from nanotrain.monitor.steptime import PHASES
from nanotrain.core.train.health import Health
from nanotrain.core.train.preempt import StopRequest
from nanotrain.core.train.schedule import LRSchedule
from nanotrain.core.train.step import Trainer
@dataclass(frozen=True)
class LoopConfig:
    steps: int                           # the run's total: a resumed trainer continues up to it
    sequences_per_step: int
    seq_len: int
    flops_per_token: float | None = None  # with peak_flops: MFU
    peak_flops: float | None = None
    save_every: int = 0                  # 0: only at the end
    host_mem_gib: float | None = None    # stop when the process's peak RSS goes over it
    max_skipped_steps: int = 10          # non-finite steps in a row that stop the run (0: never; train.health)
    schedule: LRSchedule | None = None   # set before each step (None: the optimizer's own lr throughout)


class HostMemoryExceeded(MemoryError):
    pass


def record(trainer: Trainer, result, dt: float, lcfg: LoopConfig, device: torch.device) -> dict:
    """The metrics of one step as a flat, JSON-ready dict (None where a field does not apply)."""
    rss, rss_peak = host_rss_gib()
    tok_s = lcfg.sequences_per_step * lcfg.seq_len / dt
    mfu = tok_s * lcfg.flops_per_token / lcfg.peak_flops if lcfg.peak_flops and lcfg.flops_per_token else None
    row = {"step": trainer.step_count, "loss": result.loss, "skipped": result.skipped, "step_s": dt,
           "seq_per_s": lcfg.sequences_per_step / dt, "tokens_per_s": tok_s, "mfu": mfu,
           "trained_tokens": result.tokens, "trained_tokens_per_s": result.tokens / dt,  # targets in the loss
           "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
           "rss_gib": rss, "peak_rss_gib": rss_peak}
    if device.type == "cuda":
        row["gpu_alloc_gib"] = torch.cuda.memory_allocated(device) / GIB
        row["gpu_reserved_gib"] = torch.cuda.memory_reserved(device) / GIB
    if result.copy_wait_s is not None:
        row["copy_wait_fraction"] = result.copy_wait_s / dt
    parts = {f"{p}_s": getattr(result, f"{p}_s") for p in PHASES}
    if any(v is not None for v in parts.values()):  # the step's time split (monitor.steptime), the rest as other_s
        row.update({k: v for k, v in parts.items() if v is not None})
        row["other_s"] = max(dt - sum(v for v in parts.values() if v is not None), 0.0)
    if result.loss_scale is not None:
        row["loss_scale"], row["overflow"] = result.loss_scale, result.overflow
    if result.grad_norm is not None:
        row["grad_norm"], row["clipped"] = result.grad_norm, result.clipped
    return row


def eta(since: float | None, done: int, left: int) -> float | None:
    """Seconds to the end at the pace of the steps after the first (hooks and saves included)."""
    if left == 0:
        return 0.0
    return None if since is None or done == 0 else (time.perf_counter() - since) / done * left


def run(trainer: Trainer, next_batch: Callable[[], tuple[torch.Tensor, ...]], lcfg: LoopConfig,
        sinks: list[Sink], device: torch.device, save: Callable[[], Path] | None = None,
        hooks: Sequence[Callable[[int], dict]] = (), stop: StopRequest | None = None,
        phase: Callable[[str], None] = lambda _: None) -> list[dict]:
    """Step ``trainer`` until it has made ``lcfg.steps`` steps; save on the cadence and at the end.

    Each of ``hooks`` is called after every step with the step count (samplers, evaluation, the
    profiler); the fields it returns join that step's record. Hooks run outside the step's time.
    With ``stop`` (SIGTERM, Ctrl-C: ``train.preempt``) the loop ends at the first step boundary after
    the signal (before the first step, if it came while the run was loading), saved as at the end of
    the run. ``phase`` is told what the loop is doing ("step 12", "saving step 12", ...): a distributed
    run names it when a rank fails or is lost (``DistContext.where``).

    Returns this call's records. Raises ``HostMemoryExceeded`` when the peak RSS passes the cap,
    ``health.TrainingStopped`` when steps keep being skipped (nothing saved then), and what ``save``
    raises (``disk.SaveFailed``); the caller decides whether to save and how to exit.
    """
    records, saved_at, since = [], None, None  # since: the end of this call's first step (its warm-up)
    health = Health(lcfg.max_skipped_steps)
    while trainer.step_count < lcfg.steps:
        if stop is not None and stop.requested(device):
            break
        phase(f"step {trainer.step_count + 1}")
        batch = next_batch()  # (tokens, targets), and packed rows' positions
        lr = None if lcfg.schedule is None else lcfg.schedule.lr_at(trainer.step_count)
        if lr is not None:
            trainer.set_lr(lr)
        t0 = time.perf_counter()
        result = trainer.step(*batch)
        row = record(trainer, result, time.perf_counter() - t0, lcfg, device)
        row["lr"] = lr
        step = trainer.step_count
        phase(f"the hooks after step {step} (evaluation, sampling, profiling)")
        for hook in hooks:
            row.update(hook(step))
        row["eta_s"] = eta(since, len(records), lcfg.steps - step)
        since = since or time.perf_counter()
        records.append(row)
        for sink in sinks:
            sink.write(row)
        warning = health.observe(step, result.loss, result.skipped and not result.overflow)
        if warning:
            print(warning, flush=True)
        if save is not None and lcfg.save_every and step % lcfg.save_every == 0 and step < lcfg.steps \
                and not health.skipped_run:  # no checkpoint of weights that are failing
            phase(f"saving step {step}")
            save()
            saved_at = step
        phase(f"the step boundary after step {step}")
        if lcfg.host_mem_gib is not None and row["peak_rss_gib"] > lcfg.host_mem_gib:
            raise HostMemoryExceeded(
                f"peak RSS {row['peak_rss_gib']:.2f} GiB went over --host-mem-gib {lcfg.host_mem_gib} at step {step} "
                f"(the plan's estimate of the process was too low); raise the cap")
    if not records:
        if stop is not None and stop.signal is not None:
            print(f"stopped by {stop.name} before the first step, at step {trainer.step_count}: nothing trained, "
                  f"nothing to save", flush=True)
        else:
            print(f"nothing to do: the run is at step {trainer.step_count} of {lcfg.steps} (the step count is the "
                  f"run's total; raise it to train further)", flush=True)
    else:
        health.finish(len(records))
        if save is not None and saved_at != trainer.step_count:
            phase(f"saving step {trainer.step_count}")
            path = save()
            if path is not None:  # ranks that only help a save return None and say nothing
                print(f"saved {path}", flush=True)
    phase("the end of the run")
    return records
