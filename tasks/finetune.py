"""Fine-tune GPT-2 with AdamW under a GPU memory cap: the flagship job.

    python -m tasks.finetune --model gpt2-large --gpu-mem-gib 11 --batch 64 --seq 1024 --steps 30 --data stdlib
    python -m tasks.finetune --model tiny --batch 8 --seq 128 --steps 30 --data ../shared/data/tinyshakespeare.txt

Every parameter is updated every step from fp32 master weights; the optimizer state lives in CPU
memory (``--states cpu``, the default) or on the GPU (``--states gpu``, with ``--adam-bits 8`` to
fit). One line per step, metrics in ``OUT/metrics.jsonl``, the loss curve in ``OUT/loss.png``,
checkpoints in ``OUT/step-N`` (``--save-every``, the ``--keep-last`` newest kept) that ``--resume``
continues exactly: with the saved run's settings for those not given again (a change that breaks
exactness needs ``--allow-changes``), up to ``--steps``, the run's total. A run whose steps keep
being skipped for a non-finite loss stops (``--max-skipped-steps``) without saving.

Weight streaming (``--stream``, or on its own when the model cannot fit the GPU cap otherwise):
weights, masters and moments stay in host memory and visit the GPU block by block
(``nanotrain.train.streamed``). ``--host-mem-gib`` checks the plan against a host budget before
anything is allocated, and the measured peak RSS after every step:

    python -m tasks.finetune --model gpt2-xl --gpu-mem-gib 11 --host-mem-gib 16 --adam-bits 8 --steps 30

With ``--dp N`` each rank streams its rows of the batch and keeps 1/N of the masters and moments in
its host memory (ZeRO-Offload: ``nanotrain.data_parallel.streamed``).

What a run gives besides: a learning-rate schedule (``--lr-schedule cosine --warmup-steps 100``,
kept in the checkpoints), validation on held-out data (``--val-fraction 0.05 --eval-every 50``),
gradient clipping (``--clip-norm 1.0``, every trainer and ``--dp``), fp16 with loss scaling (``--dtype fp16``), a live
dashboard (TensorBoard event files in ``OUT``: ``just dashboard OUT``), a profile of chosen steps
(``--profile-steps 10:12``), run configs (``--config run.toml``; the resolved flags are saved as
``OUT/config.toml``), and clean pre-emption: SIGTERM or Ctrl-C saves at the next step boundary,
prints the command that resumes, and ends the process by that signal (exit status 143 or 130, not 0:
the run is not done). Every checkpoint holds its files' SHA-256 (``SHA256SUMS``); a resume takes the
newest checkpoint whose files match, and says so when it is not the latest (docs/CHECKPOINTS.md).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any
from pathlib import Path

import torch

from nanotrain.models import model_spec
from nanotrain.memory.recompute import RecomputePolicy
from nanotrain.cli import (add_model_args, cuda_index, fail, given_dests, model_config, pick_device, tokenizer_dir,
                           warn_nonfinite)
from nanotrain.data_parallel import checkpoint as sharded, data_parallel_trainer, launch as dp
from nanotrain.data import BlockLoader, load_tokens
from nanotrain.flops import flops_per_token, peak_flops
from nanotrain.memory.plan import (CUDA_RUNTIME_BYTES, GIB, StreamPlan, choose_micro_batch, estimate, host_rss_gib,
                              plan_resident_host, plan_streaming, return_freed_memory_to_the_os, set_gpu_cap)
from nanotrain.memory.stream_search import StreamCosts, format_ranked, measure_link, search_streaming
from nanotrain.memory.zero_plan import ZeroPlan, plan_zero
from nanotrain.optim import AdamConfig, OffloadConfig
from nanotrain.monitor.profile import StepProfiler, parse_steps
from nanotrain.monitor import (JsonlSink, NvmlSampler, StdoutSink, TensorBoardSink, cut_jsonl, read_jsonl,
                               tensorboard_available)
from nanotrain.plot import plot_curves
from nanotrain.train import loop
from nanotrain.train.loop import LoopConfig
from nanotrain.tokenizer import TokenizerError, get_tokenizer
from nanotrain.train.evaluate import Evaluator, add_eval_args, split_tokens
from nanotrain.train.health import HealthConfig, TrainingStopped
from nanotrain.distributed.failure import RankFailure, RankLost
from nanotrain.train.disk import SaveFailed, check_writable
from nanotrain.train.preempt import StopRequest
from nanotrain.train.resume import SettingRules, check_model, restore_settings, saved_settings
from nanotrain.train.run_dir import Found, find_checkpoint, named_by_latest, remove_stale, set_aside, step_folders
from nanotrain.train.schedule import LRSchedule, add_schedule_args, schedule_from_args
from nanotrain.train.state import load_masters, restore, save_checkpoint, saved_schedule
from nanotrain.train.streamed import StreamConfig, StreamTrainer
from nanotrain.train.resident import ResidentTrainer, TrainConfig
from nanotrain.tree import set_path
from nanotrain import models as M
from nanotrain import toml_config
from weights import CheckpointError, load_weights


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, default_model="gpt2-large", default_weights="random")
    ap.add_argument("--data", default="stdlib", help="a text or .jsonl file, or 'stdlib' (Python's own sources)")
    add_eval_args(ap)
    ap.add_argument("--batch", type=int, default=64, help="sequences per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per forward pass (default: from the cap)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--gpu-mem-gib", type=float, default=None, help="cap on GPU memory, enforced")
    ap.add_argument("--host-mem-gib", type=float, default=None,
                    help="cap on this process's host memory (peak RSS, locked buffers included): plans that "
                         "cannot fit are refused, and a step that overshoots stops the run")
    ap.add_argument("--stream", action="store_true",
                    help="stream weights block by block (default: only when the GPU cap needs it)")
    ap.add_argument("--tail", type=int, default=None,
                    help="with --stream: the top N blocks run with the head, micro-batch by micro-batch, "
                         "without recompute (default on a GPU: the plan predicted fastest within the caps; 0: none)")
    ap.add_argument("--tail-micro-batch", type=int, default=None,
                    help="sequences per pass through the tail (default: planned with --tail)")
    ap.add_argument("--recompute", "--checkpoint", dest="recompute", default="none",
                    help="activation recompute policy (--checkpoint is its old name): none, lean, selective, every, "
                         "every-K")
    ap.add_argument("--adam-bits", type=int, default=32, choices=[32, 8])
    ap.add_argument("--states", default="cpu", choices=["cpu", "gpu"], help="where masters and moments live")
    ap.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    add_schedule_args(ap)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip-norm", type=float, default=None,
                    help="clip gradients to this global norm (exact; the update then waits for the whole backward, "
                         "but with --clip-overlap it updates speculatively and redoes a clipped step: "
                         "nanotrain/optim/clip_redo.py; with --stream the blocks' gradients wait in host memory, with "
                         "--dp each rank's shards of the reduced gradients: nanotrain/train/deferred.py)")
    ap.add_argument("--clip-overlap", action="store_true",
                    help="with --clip-norm (resident trainer): keep the update overlapped with backward by updating "
                         "speculatively, at the cost of a second copy of masters and moments in host memory "
                         "(always so with --dtype fp16 --dp N)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                    help="compute dtype (auto: bf16 on a GPU, fp32 on the CPU); fp16, for GPUs without bf16, scales "
                         "the loss dynamically (nanotrain/train/scaler.py)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (--recompute none, or --stream)")
    ap.add_argument("--fixed-batch", action="store_true", help="train on the first batch every step")
    ap.add_argument("--out", type=Path, default=Path("runs/finetune"))
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from OUT/latest (or, if its files do not match their SHA256SUMS or are missing, the "
                         "newest intact checkpoint), with the saved run's settings for those not given again; --steps "
                         "is the run's total")
    ap.add_argument("--allow-changes", action="store_true",
                    help="with --resume: accept a --batch, --seq, --lr, ... other than the saved run's")
    ap.add_argument("--keep-last", type=int, default=3, help="checkpoints kept (the newest ones; 0: all)")
    ap.add_argument("--max-skipped-steps", type=int, default=10,
                    help="stop the run after this many steps in a row with a non-finite loss (0: never)")
    ap.add_argument("--profile-steps", default=None, metavar="A:B",
                    help="torch.profiler over steps A to B: OUT/profile/trace-rank0.json (Perfetto) and a summary")
    ap.add_argument("--no-tensorboard", dest="tensorboard", action="store_false",
                    help="no TensorBoard event files in OUT (written by default when tensorboard is installed; "
                         "view them with: just dashboard OUT)")
    dp.add_dp_args(ap)
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return toml_config.parse_args(parser(), argv)  # --config run.toml under the command line


# How --resume treats the saved run's settings (nanotrain.train.resume): kept are this process's own,
# quiet ones change freely, exact ones would make the run differ from the uninterrupted one, fixed
# ones cannot load; any other (--dp, --zero, --sharded-save, --micro-batch, --recompute, --stream, ...)
# is restored, changes warned. All of it happens before any setting is checked.
RESUME_RULES = SettingRules(
    kept=frozenset({"resume", "out", "device", "tokenizer_dir", "weights", "gpu_mem_gib", "host_mem_gib",
                    "allow_changes", "config", "profile_steps", "tensorboard"}),
    quiet=frozenset({"steps", "save_every", "keep_last", "max_skipped_steps", "eval_every", "eval_batches",
                     "clip_overlap", "dp_check"}),
    exact=frozenset({"batch", "seq", "lr", "weight_decay", "data", "seed", "fixed_batch", "clip_norm",
                     "lr_schedule", "warmup_steps", "decay_steps", "min_lr", "dp_reduce_dtype"}),
    fixed=frozenset({"model", "adam_bits"}))


def cpu_stream_micro_batch(args: argparse.Namespace) -> int:
    batch = args.batch // args.dp  # each data-parallel rank's share
    return args.micro_batch or max(d for d in range(1, min(batch, 8) + 1) if batch % d == 0)


def check_args(args: argparse.Namespace, cfg: Any, device: torch.device) -> None:
    """Every setting that can be wrong on its own, before anything is loaded or built: one error line."""
    positive = {"--steps": args.steps, "--batch": args.batch, "--seq": args.seq}
    for flag, value in positive.items():
        if value < 1:
            fail(f"{flag} {value} must be at least 1")
    if args.seq > cfg.n_ctx:
        fail(f"--seq {args.seq} exceeds {args.model}'s context of {cfg.n_ctx} tokens; use --seq {cfg.n_ctx} or less")
    if args.micro_batch is not None and (args.micro_batch < 1 or args.batch % args.micro_batch):
        fail(f"--micro-batch {args.micro_batch} does not divide --batch {args.batch}; pick one of "
             f"{', '.join(str(d) for d in range(1, args.batch + 1) if args.batch % d == 0)}")
    for flag, value in {"--lr": args.lr, "--weight-decay": args.weight_decay}.items():
        if not 0 <= value < float("inf"):
            fail(f"{flag} {value} must be a finite number >= 0")
    for flag, value in {"--save-every": args.save_every, "--keep-last": args.keep_last,
                        "--max-skipped-steps": args.max_skipped_steps, "--tail": args.tail or 0}.items():
        if value < 0:
            fail(f"{flag} {value} must be >= 0")
    if args.clip_overlap and (args.clip_norm is None or args.stream or args.dp > 1):
        fail("--clip-overlap keeps the resident trainer's update overlapped while clipping: it needs --clip-norm, and "
             "applies neither with --stream (whose updates wait for the norm) nor with --dp; drop it")
    if (args.tail or 0) > cfg.n_layer:
        fail(f"--tail {args.tail}: {args.model} has only {cfg.n_layer} blocks")
    t = args.tail_micro_batch
    if t is not None and (t < 1 or args.micro_batch and args.micro_batch % t):
        fail(f"--tail-micro-batch {t} must divide --micro-batch {args.micro_batch}")
    try:
        policy = RecomputePolicy.parse(args.recompute)
    except ValueError as e:
        fail(str(e))
    for flag, value in {"--gpu-mem-gib": args.gpu_mem_gib, "--host-mem-gib": args.host_mem_gib}.items():
        if value is not None and not value > 0:
            fail(f"{flag} {value} must be above 0")
    if args.dp > 1 and args.gpu_mem_gib is not None and not args.stream:  # arithmetic: before any process starts
        try:
            dp_memory_plan(args, cfg)
        except MemoryError as e:
            fail(str(e))
    if args.gpu_mem_gib is not None and device.type != "cuda":
        fail(f"--gpu-mem-gib {args.gpu_mem_gib} caps GPU memory, but this run is on {device} (no CUDA GPU); leave "
             f"it out (--host-mem-gib caps host memory)")
    if device.type != "cuda":  # no device plan: check the host one now
        micro = cpu_stream_micro_batch(args) if args.stream else args.micro_batch or args.batch // args.dp
        try:
            check_resident_host(args, cfg, micro, RecomputePolicy.parse("every") if args.stream else policy, False)
        except MemoryError as e:
            fail(str(e))


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


def prepare_resume(args: argparse.Namespace, argv: list[str] | None) -> Found | None:
    """With --resume: the checkpoint (the newest whose files match their checksums), the saved run's
    settings put back into ``args`` (changes said or refused). Without: None, after refusing a folder
    that holds another run. Reads, never writes."""
    if not args.resume:
        if (args.out / "latest").exists() or step_folders(args.out):
            fail(f"{args.out} holds a run's checkpoints; pass --resume to continue it, or another --out to start a "
                 f"new one")
        return None
    try:
        found = find_checkpoint(args.out)
        saved = saved_settings(found.path)
        for line in restore_settings(vars(args), given_dests(parser(), argv), saved, RESUME_RULES,
                                     args.allow_changes):
            print(line, flush=True)
    except (CheckpointError, ValueError) as e:
        fail(str(e))
    if found.note:
        print(f"warning: {found.note}", flush=True)
    return found


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


def main(argv: list[str] | None = None) -> None:
    # SIGTERM and Ctrl-C are caught from the start: during training they stop it at the step boundary,
    # saved; before it (loading, checking) they stop it before the first step (nanotrain.train.preempt).
    with StopRequest() as stop:
        train(argv, stop)


def train(argv: list[str] | None, stop: StopRequest) -> None:
    args = parse_args(argv)
    dp.resume_after_restart(args)
    dp.mute_other_ranks()
    found = prepare_resume(args, argv)  # every saved setting back in place before any is checked
    ckpt = found and found.path
    try:
        dp.check_dp_args(args, resumed=ckpt is not None and "batch" not in given_dests(parser(), argv))
    except ValueError as e:
        fail(str(e))
    cfg = model_config(args.model)
    check_args(args, cfg, pick_device(args.device))  # here, before local data-parallel processes start
    start = 0
    if ckpt is not None:
        try:
            check_model(ckpt, cfg, args.model, saved_settings(ckpt).get("model"))
            if sharded.is_sharded(ckpt):
                sharded.check_world(ckpt, args.dp)
        except CheckpointError as e:
            fail(str(e))
        start = int(json.loads((ckpt / "trainer.json").read_text())["step"])
    if start >= args.steps:
        print(f"nothing to do: {ckpt} is at step {start} and --steps {args.steps} is the run's total; raise "
              f"--steps to train further", flush=True)
        return
    try:
        check_writable(args.out)
    except CheckpointError as e:
        fail(str(e))
    if stop.signal is not None:  # signalled while checking: nothing has started
        print(f"stopped by {stop.name} before training started", flush=True)
        stop.exit_if_stopped()
    if dp.started_here(args, main, argv):
        return
    ctx = dp.join(args)
    device = ctx.device if ctx else pick_device(args.device)
    if device.type == "cuda":
        device = cuda_index(device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        tok = get_tokenizer(tokenizer_dir(args.tokenizer_dir))
        tokens, val_tokens = load_data(args, tok)
        loader = BlockLoader(tokens, args.seq, args.batch, seed=args.seed)  # a corpus too short fails here
        plan = None
        if not args.stream:
            try:
                micro = plan_micro_batch(args, cfg, device, dtype)
            except MemoryError as e:
                print(f"{e}\n-> streaming the weights instead", flush=True)
                args.stream = True
                dp.check_dp_args(args)  # what --stream allows with --dp
            else:
                if device.type == "cuda":
                    check_resident_host(args, cfg, micro, RecomputePolicy.parse(args.recompute), True)
        if args.stream:  # refuse a plan that cannot fit before loading anything
            plan = plan_stream(args, cfg, device, dtype, ctx)
            micro = plan.micro_batch
        tcfg = train_config(args, micro, plan)  # bad settings fail here, before the weights load
        dp.check_split(args.batch, micro, args.dp)
        if ctx is None or ctx.rank == 0:
            start_disk(args, start, found.corrupt if found else ())
            toml_config.write_config(args, args.out / "config.toml")
        schedule = schedule_from_args(args) if ckpt is None else resumed_schedule(args, saved_schedule(ckpt), start)
        profile_range = None if args.profile_steps is None else parse_steps(args.profile_steps)
        if ckpt is not None:
            params = M.empty_tree(cfg)
            for path, t in (sharded.load_masters if sharded.is_sharded(ckpt) else load_masters)(ckpt).items():
                set_path(params, path, t)
        else:
            params = load_weights(cfg, args.weights, seed=args.seed)
    except (TokenizerError, CheckpointError, FileNotFoundError, ValueError, MemoryError) as e:
        fail(str(e))
    warn_nonfinite(params, ckpt or args.weights)
    ocfg = OffloadConfig(device=str(device), dtype=dtype, offload=args.states == "cpu", state_bits=args.adam_bits,
                         keep_32bit=model_spec(cfg).fp32_moments,
                         exact_skip=exact_skip(args) and plan is None)
    adam = AdamConfig(lr=args.lr, weight_decay=args.weight_decay)
    try:
        if ctx:
            trainer = data_parallel_trainer(cfg, params, tcfg, adam, ocfg, dp.dp_config(args), ctx.grid.dp_group)
        else:
            trainer = (StreamTrainer if plan is not None else ResidentTrainer)(cfg, params, tcfg, adam, ocfg)
    except (ValueError, MemoryError) as e:
        fail(str(e))
    del params
    if ckpt is not None:
        try:
            loader.position = (sharded.restore_any if sharded.is_sharded(ckpt) else restore)(trainer, ckpt)
        except CheckpointError as e:  # e.g. 8-bit moments saved sharded, resumed at another --dp
            trainer.close()
            fail(str(e))
        print(f"resumed from {ckpt} at step {trainer.step_count}", flush=True)
    fixed = loader.next_batch() if args.fixed_batch else None
    try:
        evaluator = None if val_tokens is None else Evaluator(trainer, validation_batches(val_tokens, args),
                                                              args.eval_every, args.steps)
    except ValueError as e:
        trainer.close()
        sys.exit(f"error: {e}")

    print(f"{args.model}: {model_spec(cfg).costs.total_params / 1e6:.0f}M parameters, batch {args.batch} x {args.seq} as "
          f"{args.batch // micro} micro-batches of {micro}{dp.describe(args)}, "
          f"{'weights streamed block by block' if args.stream else f'recompute {args.recompute}'}, "
          f"{args.adam_bits}-bit Adam states "
          f"{'in host memory, updated on the device' if args.stream else f'on {args.states}'}, {dtype} compute on "
          f"{device}; {schedule.describe()}", flush=True)
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    lcfg = LoopConfig(steps=args.steps, sequences_per_step=args.batch, seq_len=args.seq,
                      flops_per_token=flops_per_token(cfg, args.seq),
                      peak_flops=peak and peak * args.dp,  # every rank's GPU works on the batch
                      save_every=args.save_every, host_mem_gib=args.host_mem_gib, schedule=schedule,
                      health=HealthConfig(max_skipped_steps=args.max_skipped_steps))
    first = ctx is None or ctx.rank == 0
    sinks = [StdoutSink(), JsonlSink(args.out / "metrics.jsonl")] + dashboard(args, trainer.step_count) if first else []
    profiler = None if args.profile_steps is None else StepProfiler(*profile_range, args.out / "profile", device,
                                                                     done_steps=trainer.step_count)
    hooks = [h for h in (NvmlSampler.start(device), evaluator, profiler) if h is not None]
    meta = vars_json(args)
    save = lambda: save_checkpoint(args.out, trainer, loader.position, meta, schedule,  # noqa: E731
                                   keep_last=args.keep_last)
    if args.sharded_save:  # every rank writes its own shard
        save = lambda: sharded.save_sharded(args.out, trainer, loader.position, meta, schedule,  # noqa: E731
                                            keep_last=args.keep_last)
    elif not first:  # the others help gather the state that the first saves
        save = lambda: (trainer.state_dict(), None)[1]  # noqa: E731
    records = []
    phase = (lambda what: setattr(ctx, "where", what)) if ctx else (lambda _: None)  # named if a rank fails
    try:
        with dp.guard(ctx):
            records = loop.run(trainer, (lambda: fixed) if fixed is not None else loader.next_batch, lcfg, sinks,
                               device, save=save, hooks=hooks, stop=stop, phase=phase)
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
        dp.leave(ctx)
    if records and first:
        plot_run(args)
    if stop.signal is not None and trainer.step_count < args.steps:
        if records:
            again = list(sys.argv[1:] if argv is None else argv) + ([] if args.resume else ["--resume"])
            print(f"stopped by {stop.name} at step {trainer.step_count} of {args.steps}, saved in {args.out}; "
                  f"continue with:\n  python -m tasks.finetune {shlex.join(again)}", flush=True)
        stop.exit_if_stopped()  # by the signal, not 0: the run is not done (nanotrain.train.preempt)


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


def load_data(args: argparse.Namespace, tok) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The training tokens and the held-out ones (None without --val-fraction or --val-data)."""
    tokens = load_tokens(args.data, tok)
    if args.val_data is not None and args.val_fraction:
        raise ValueError("give --val-data or --val-fraction, not both")
    if args.val_data is not None:
        return tokens, load_tokens(args.val_data, tok)
    if args.val_fraction:
        return split_tokens(tokens, args.val_fraction)
    if args.eval_every:
        raise ValueError(f"--eval-every {args.eval_every} needs held-out data: add --val-fraction 0.05 or --val-data "
                         f"FILE")
    return tokens, None


def validation_batches(tokens: torch.Tensor, args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``--eval-batches`` batches of the held-out blocks in a seeded order: the same at every eval."""
    try:
        loader = BlockLoader(tokens, args.seq, args.batch, seed=args.seed)
    except ValueError as e:
        raise ValueError(f"validation data: {e}") from None
    return [loader.next_batch() for _ in range(min(args.eval_batches, loader.num_blocks // args.batch))]


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
    """The whole run's loss curve, resumed segments included (the last record of each step wins)."""
    losses = [row["loss"] for row in read_jsonl(args.out / "metrics.jsonl") if row["loss"] is not None]
    if losses:
        plot_curves({f"{args.model} loss": losses}, args.out / "loss.png",
                    f"{args.model}: batch {args.batch} x {args.seq}, "
                    + ("weights streamed" if args.stream else f"recompute {args.recompute}"))


def vars_json(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


if __name__ == "__main__":
    main()
