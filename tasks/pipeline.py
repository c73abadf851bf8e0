"""Train with pipeline parallelism and check it converges exactly like one process.

Trains GPT-2 on Tiny Shakespeare (``--task gpt2``) or a CNN on CIFAR-10 (``--task cnn``; a
synthetic stand-in when torchvision or the data is missing) with each requested schedule, then
the same model, data and initialisation in a single process, and writes the loss curves to
``OUT/<task>_losses.json`` and an overlay plot ``OUT/<task>_loss.png``; each schedule's dashboard
(every rank's step time and memory, gathered on rank 0) goes to ``OUT/tensorboard/<schedule>``.

The defaults are a demo that takes about a minute on a laptop CPU (4 processes, 20 steps of 8
micro-batches of 1 x 32 tokens, every schedule, then the single process); the run in
docs/BENCHMARKS.md is ``--steps 60 --micro-batch-size 4 --seq 64`` (several minutes).

Launch, all with the same arguments:

    python -m tasks.pipeline --stages 4 ...                        # spawns 4 local processes
    torchrun --nproc-per-node 4 -m tasks.pipeline --stages 4 ...   # one node under torchrun
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        --rdzv-id JOB -m tasks.pipeline --stages 8 ...             # on every node

Under torchrun spell ``--virtual-stages`` out: torchrun reads the old name ``--virtual`` as an
abbreviation of its own ``--virtual-local-rank`` and stops (``ambiguous option``).

Processes use NCCL with one GPU each when CUDA is available, else gloo on CPU. Under torchrun
rank 0 runs the single-process reference after the pipeline runs and writes the results.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from nanotrain.cifar import cnn_loss, load_cifar10, make_cnn_layers, normalize
from nanotrain import toml_config
from nanotrain.models import model_spec, preset
from nanotrain.data import random_windows, split_tokens
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from nanotrain.monitor import GatherRanks, NvmlSampler, StdoutSink, TensorBoardSink, tensorboard_available
from nanotrain.pipeline import (SCHEDULES, LayeredModel, build_pipeline, build_schedule, reference_loss,
                                sequential_layered)
from nanotrain.pipeline.build import materialize
from nanotrain.pipeline.costs import balance_by_measurement
from nanotrain.pipeline.layered import computing_in, describe
from nanotrain.plot import plot_curves
from nanotrain.tokenizer import ByteTokenizer, TokenizerError, get_tokenizer
from nanotrain.train import loop
from nanotrain.train.adapters import AutogradTrainer, PipelineTrainer
from nanotrain.train.evaluate import Evaluator, add_eval_args
from nanotrain.train.loop import LoopConfig
from nanotrain.train.scaler import LossScaler
from nanotrain.train.schedule import add_schedule_args, schedule_from_args
from nanotrain.monitor.profile import StepProfiler, parse_steps
from nanotrain.tree import named_leaves

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@dataclass(frozen=True)
class Task:
    model: LayeredModel
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # step -> (inputs [B, ...], targets [B, ...])
    val: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # held-out batches (--val-fraction)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tasks.pipeline", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("gpt2", "cnn"), default="gpt2")
    p.add_argument("--schedule", default="all", help=f"comma-separated, or 'all': {', '.join(SCHEDULES)}")
    p.add_argument("--stages", type=int, default=4, help="pipeline ranks (processes); stages = ranks x "
                                                         "--virtual-stages for interleaved-1f1b")
    p.add_argument("--virtual-stages", "--virtual", type=int, default=2,
                   help="stages per rank for interleaved-1f1b (--virtual, its old name, clashes with torchrun's "
                        "--virtual-local-rank)")
    p.add_argument("--balance", choices=("flops", "measured"), default="flops",
                   help="split stages by FLOP counts, or by each layer's forward+backward timed on this device")
    p.add_argument("--split", default=None, help="middle layers per stage, e.g. 3,2,2,1, for the schedules with one "
                                                 "stage per rank (default, and interleaved: balanced by cost)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-3 gpt2, 5e-4 cnn)")
    add_schedule_args(p)
    p.add_argument("--clip-norm", type=float, default=None, help="clip gradients to this global norm (whole model)")
    p.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32",
                   help="compute dtype; fp16 (fp32 masters) scales the loss dynamically, as GradScaler")
    add_eval_args(p, val_data=False)
    p.add_argument("--profile-steps", default=None, metavar="A:B",
                   help="torch.profiler over steps A to B of each schedule: OUT/profile/<schedule>/trace-rank<r>.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny", help="model preset (tiny, gpt2, gpt2-medium, ...)")
    p.add_argument("--n-layer", type=int, default=8, help="blocks (0: the preset's); at least the stage count")
    p.add_argument("--seq", type=int, default=32, help="sequence length")
    p.add_argument("--tokenizer", choices=("gpt2", "bytes"), default="gpt2",
                   help="gpt2: the real BPE (tiktoken, offline from the shared tokenizer files); bytes: vocabulary 256")
    p.add_argument("--data", type=Path, default=SHARED_DATA / "tinyshakespeare.txt")
    p.add_argument("--cifar-root", type=Path, default=REPO / "data" / "cifar10")
    p.add_argument("--out", type=Path, default=Path("runs/pipeline"))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any rank may wait on another")
    args = toml_config.parse_args(p, argv)  # --config run.toml under the command line
    for flag, value in (("--steps", args.steps), ("--stages", args.stages), ("--microbatches", args.microbatches),
                        ("--micro-batch-size", args.micro_batch_size), ("--seq", args.seq)):
        if value < 1:
            p.error(f"{flag} {value} must be at least 1")
    args.schedules = list(SCHEDULES) if args.schedule == "all" else args.schedule.split(",")
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown:
        p.error(f"unknown schedule {unknown[0]!r} (known: {', '.join(SCHEDULES)}, or all)")
    args.lr = args.lr or (1e-3 if args.task == "gpt2" else 5e-4)
    try:
        schedule_from_args(args)  # bad settings fail here
        args.profile_range = None if args.profile_steps is None else parse_steps(args.profile_steps)
    except ValueError as e:
        p.error(str(e))
    if args.eval_every and not args.val_fraction:
        p.error(f"--eval-every {args.eval_every} needs held-out data: add --val-fraction 0.05")
    return args


def load_text(args: argparse.Namespace) -> torch.Tensor:
    """The corpus as int64 token ids: GPT-2 BPE from the hash-checked files, or UTF-8 bytes."""
    if args.tokenizer == "bytes":
        tok = ByteTokenizer()
    else:
        files = SHARED_DATA / "gpt2-tokenizer"
        if not files.is_dir():
            raise SystemExit(f"error: GPT-2 tokenizer files vocab.bpe and encoder.json not found in {files}; "
                             f"use --tokenizer bytes")
        try:
            tok = get_tokenizer(str(files))
        except TokenizerError as e:
            raise SystemExit(f"error: {e}") from None
    return torch.tensor(tok.encode_ordinary(args.data.read_text(encoding="utf-8")), dtype=torch.int64)


def make_task(args: argparse.Namespace) -> Task:
    """The model and a deterministic batch per step, identical in every process."""
    batch_size = args.microbatches * args.micro_batch_size
    if args.task == "gpt2":
        tokens, val = load_text(args), None
        if args.val_fraction:
            tokens, held_out = split_tokens(tokens, args.val_fraction)
            val = [random_windows(held_out, args.seq, batch_size, args.seed, k) for k in range(args.eval_batches)]
        overrides = {"vocab_size": 256} if args.tokenizer == "bytes" else {}
        spec = model_spec(preset(args.model, **overrides, **({"n_layer": args.n_layer} if args.n_layer else {})))
        if args.seq > spec.n_ctx:
            raise SystemExit(f"error: --seq {args.seq} exceeds {args.model}'s context of {spec.n_ctx}; "
                             f"use --seq {spec.n_ctx}")
        return Task(computing(LayeredModel.from_spec(spec, args.seq), args),
                    lambda step: random_windows(tokens, args.seq, batch_size, args.seed, step), val)
    images, labels = load_cifar10(str(args.cifar_root), train=True, download=True)
    images = normalize(images)

    def image_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(labels), (batch_size,), generator=torch.Generator().manual_seed(args.seed + step))
        return images[idx], labels[idx]

    val = None
    if args.val_fraction:  # CIFAR-10's test split (or the stand-in's)
        test_x, test_y = load_cifar10(str(args.cifar_root), train=False, download=True)
        test_x = normalize(test_x)
        val = [(test_x[k * batch_size:(k + 1) * batch_size], test_y[k * batch_size:(k + 1) * batch_size])
               for k in range(min(args.eval_batches, len(test_y) // batch_size))]
    return Task(computing(sequential_layered(make_cnn_layers(), cnn_loss), args), image_batch, val)


def computing(model: LayeredModel, args: argparse.Namespace) -> LayeredModel:
    """The model as ``--dtype`` computes it: fp16 casts each layer's fp32 parameters as it runs."""
    return computing_in(model, torch.float16) if args.dtype == "fp16" else model


def scaler(args: argparse.Namespace) -> LossScaler | None:
    return LossScaler() if args.dtype == "fp16" else None


def train(trainer, task: Task, args: argparse.Namespace, sinks: list, device: torch.device = torch.device("cpu"),
          name: str = "single process", rank: int = 0) -> list[float]:
    """The one loop over ``task``'s batches, with the schedule, validation and profiler asked for; the loss curve."""
    lcfg = LoopConfig(steps=args.steps, sequences_per_step=args.microbatches * args.micro_batch_size,
                      seq_len=args.seq if args.task == "gpt2" else 1, schedule=schedule_from_args(args))
    profiler = None if args.profile_range is None else StepProfiler(
        *args.profile_range, args.out / "profile" / name.replace(" ", "-"), device, rank)
    evaluator = None if task.val is None else Evaluator(trainer, task.val, args.eval_every, args.steps)
    closing = [h for h in (NvmlSampler.start(device), profiler) if h is not None]
    try:
        records = loop.run(trainer, lambda: task.batch(trainer.step_count), lcfg, sinks, device,
                           hooks=closing + ([evaluator] if evaluator else []))
    finally:
        for c in sinks + closing:
            c.close()
    return [r["loss"] for r in records]


def rank_sinks(ctx, args: argparse.Namespace, name: str) -> list:
    """Every rank's records gathered to rank 0, which prints every 10th step and feeds TensorBoard."""
    inner = []
    if ctx.rank == 0:
        inner = [StdoutSink(10, f"{name:>16s} ")]
        if tensorboard_available():
            inner.append(TensorBoardSink(args.out / "tensorboard" / name))
    return [GatherRanks(inner, ctx.grid.pp_group)]


def pipelined(args: argparse.Namespace) -> dict[str, list[float]]:
    """This process's part of every schedule's training run; returns each schedule's loss curve."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    ctx = init_distributed(GridConfig(pp=launched_world_size()), timeout_s=args.timeout)
    task = make_task(args)
    curves = {}
    with ctx.guard():
        model = task.model
        if args.balance == "measured":
            x, y = (t[:args.micro_batch_size] for t in task.batch(0))
            model = balance_by_measurement(ctx, model, x, y, torch.float32)
        for name in args.schedules:
            schedule = build_schedule(name, ctx.world_size, args.microbatches, args.virtual_stages)
            one_per_rank = schedule.n_stages == ctx.world_size
            counts = [int(c) for c in args.split.split(",")] if args.split and one_per_rank else None
            example = task.batch(0)[0][:args.micro_batch_size]
            pipe = build_pipeline(ctx, model, schedule, example, counts, args.seed)
            if ctx.rank == 0:
                print(f"{name}:\n{describe(pipe.specs)}", flush=True)
            trainer = PipelineTrainer(pipe, torch.optim.AdamW(pipe.parameters(), lr=args.lr), args.microbatches,
                                      clip_norm=args.clip_norm, scaler=scaler(args))
            curves[name] = train(trainer, task, args, rank_sinks(ctx, args, name), ctx.device, name, ctx.rank)
    close_distributed(ctx)
    return curves


def single_process(args: argparse.Namespace) -> list[float]:
    """The same training, whole batch at once, in this process."""
    task = make_task(args)
    params = materialize(task.model, set(task.model.shapes), args.seed, torch.device("cpu"), torch.float32)
    leaves = [t for _, t in named_leaves(params) if isinstance(t, torch.Tensor)]
    trainer = AutogradTrainer(params, lambda x, y: reference_loss(task.model, params, x, y),
                              torch.optim.AdamW(leaves, lr=args.lr), clip_norm=args.clip_norm, scaler=scaler(args))
    sinks = [StdoutSink(10, f"{'single process':>16s} ")] if args.val_fraction else []
    return train(trainer, task, args, sinks)


def report(args: argparse.Namespace, curves: dict[str, list[float]]) -> None:
    print("single process reference ...", flush=True)
    curves = {"single process": single_process(args), **curves}
    ref = curves["single process"]
    print(f"{'run':>18s} {'first loss':>11s} {'last loss':>10s} {'max |diff| vs single process':>29s}")
    for name, c in curves.items():
        print(f"{name:>18s} {c[0]:11.5f} {c[-1]:10.5f} {max(abs(a - b) for a, b in zip(c, ref, strict=True)):29.2e}")
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path = args.out / f"{args.task}_losses.json"
    path.write_text(json.dumps({"config": config, "curves": curves}, indent=1))
    print(f"wrote {path}")
    plot_curves(curves, args.out / f"{args.task}_loss.png", f"{args.task}: {args.stages} ranks, {args.microbatches} "
         f"micro-batches of {args.micro_batch_size}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        if int(os.environ["WORLD_SIZE"]) != args.stages:
            raise SystemExit(f"error: --stages {args.stages} but torchrun started {os.environ['WORLD_SIZE']} "
                             f"processes; pass --stages {os.environ['WORLD_SIZE']}")
        curves = pipelined(args)
        if int(os.environ["RANK"]) == 0:
            report(args, curves)
        return
    report(args, spawn(pipelined, args.stages, (args,), timeout_s=24 * 3600, capture=False)[0])


if __name__ == "__main__":
    main()
