"""What ``tasks.pipeline`` and ``tasks.tensor_parallel`` share: a parallel run beside one process, the loss
curves overlaid.

A language model trains through the one run path (``tasks.finetune``, ``nanotrain.run``) twice, with
``--pp``/``--tp`` and without, each into its run folder; the curves are read back from the folders'
``metrics.jsonl``. A CIFAR model (``tasks.demos.cifar``), which no run path serves, trains in ``train_images``:
the one loop over seeded batches, validated on CIFAR-10's test split, on ranks started by ``on_ranks``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tasks.demos.cifar import load_cifar10, normalize
from nanotrain.run.cli import resolve
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, spawn
from nanotrain.monitor import GatherRanks, NvmlSampler, StdoutSink, TensorBoardSink, read_jsonl, tensorboard_available
from nanotrain.core.models import model_spec
from nanotrain.monitor.profile import StepProfiler, parse_steps
from nanotrain.monitor.plot import plot_curves
from nanotrain.run import finetune
from nanotrain.core.train import loop
from nanotrain.core.train.evaluate import Evaluator, add_eval_args
from nanotrain.core.train.schedule import add_schedule_args, schedule_from_args

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
BPE_IDS = 50257  # GPT-2's vocabulary: a model with fewer embeddings reads text as bytes
Run = dict[str, Any]  # "loss": one per step, "val_loss": one per validation (and a CIFAR run's "data")


def add_args(p: argparse.ArgumentParser, gone: dict[str, str]) -> None:
    """The flags both demos take; ``gone``: flags they no longer take, each refused with its replacement."""
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    add_schedule_args(p)
    add_eval_args(p, val_data=False)
    p.add_argument("--profile-steps", default=None, metavar="A:B", help="torch.profiler over steps A to B of each run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=str(SHARED_DATA / "tinyshakespeare.txt"), help="the language model's text")
    p.add_argument("--tokenizer", choices=("gpt2", "bytes"), default="gpt2",
                   help=f"gpt2: the model's own (GPT-2's BPE for GPT-2 presets); bytes: the text's UTF-8 bytes, no "
                        f"tokenizer files needed (always so for a vocabulary under {BPE_IDS} ids: tiny-llama)")
    p.add_argument("--tokenizer-dir", default=None, help="the tokenizer's folder (tasks.finetune --tokenizer-dir)")
    p.add_argument("--cifar-root", "--cifar-dir", default=".cache/cifar10", help="CIFAR-10 (torchvision's layout)")
    for flag, why in gone.items():
        p.add_argument(flag, nargs="?", help=argparse.SUPPRESS, action=Gone, why=why)


def check(p: argparse.ArgumentParser, args: argparse.Namespace, counts: dict[str, int], images: bool) -> None:
    """Refuse, as ``p``'s one-line error, counts under 1 and settings the runs would refuse only once started;
    ``images``: the run trains a CIFAR model."""
    for flag, value in counts.items():
        if value < 1:
            p.error(f"{flag} {value} must be at least 1")
    if images and args.val_fraction:
        p.error("--val-fraction holds out a language model's text; the CIFAR models validate on CIFAR-10's test "
                "split always")
    try:
        schedule_from_args(args)
        if args.profile_steps is not None:
            parse_steps(args.profile_steps)
    except ValueError as e:
        p.error(str(e))


class Gone(argparse.Action):
    def __init__(self, *a: Any, why: str, **k: Any):
        super().__init__(*a, **k)
        self.why = why

    def __call__(self, p: argparse.ArgumentParser, *_: Any) -> None:
        p.error(f"{self.option_strings[0]} {self.why}")


def lm_flags(args: argparse.Namespace, names: tuple[str, ...] = (
        "model", "seq", "steps", "lr", "seed", "lr_schedule", "warmup_steps", "decay_steps", "min_lr", "val_fraction",
        "eval_every", "eval_batches", "profile_steps", "tokenizer_dir")) -> list[str]:
    """The flags ``names`` of ``args`` (those not None), which ``tasks.finetune`` takes as they are."""
    return [f for n in names if getattr(args, n) is not None
            for f in (f"--{n.replace('_', '-')}", str(getattr(args, n)))]


def text_data(args: argparse.Namespace, folder: Path) -> str:
    """``--data`` as the run reads it: the text, or (``--tokenizer bytes``, or a vocabulary without GPT-2's BPE)
    its UTF-8 bytes, one token each, written as a token file into ``folder`` (``nanotrain.data.token_files``)."""
    if args.tokenizer == "gpt2" and model_spec(resolve(args.model).cfg).vocab_size >= BPE_IDS:
        return args.data
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "bytes.npy", np.frombuffer(Path(args.data).read_bytes(), dtype=np.uint8).astype(np.uint16))
    return str(folder / "bytes.npy")


def run_path(argv: list[str], folder: Path) -> Run:
    """``tasks.finetune`` with ``argv`` into ``folder`` (started afresh, nothing saved); its curves. It starts the
    processes ``--tp``/``--pp`` ask for, or joins torchrun's; under torchrun a single-process run gets its own."""
    (folder / "metrics.jsonl").unlink(missing_ok=True)
    argv = [*argv, "--out", str(folder), "--no-save"]
    if "RANK" in os.environ and "--tp" not in argv and "--pp" not in argv:
        spawn(finetune.main, 1, (argv,), timeout_s=math.inf, capture=False)
    else:
        finetune.main(argv)
    if "RANK" in os.environ and int(os.environ["RANK"]):
        return {}
    return curves(read_jsonl(folder / "metrics.jsonl"))


def curves(records: list[dict]) -> Run:
    return {key: [r[key] for r in records if r.get(key) is not None] for key in ("loss", "val_loss")}


def train_images(trainer: Any, args: argparse.Namespace, name: str, ctx: Any = None) -> Run:
    """The one loop over ``args.batch`` seeded CIFAR images a step, validated on the test split (every
    ``--eval-every`` steps and after the last); rank 0 prints every 10th step and writes the dashboard."""
    (x, y), (test_x, test_y) = load_cifar10(args.cifar_root, train=True), load_cifar10(args.cifar_root, train=False)
    x, test_x, n = normalize(x), normalize(test_x), args.batch
    device, rank = (ctx.device, ctx.rank) if ctx else (torch.device("cpu"), 0)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(y), (n,), generator=torch.Generator().manual_seed(args.seed + trainer.step_count))
        return x[idx], y[idx]

    held_out = [(test_x[k * n:(k + 1) * n], test_y[k * n:(k + 1) * n]) for k in range(min(args.eval_batches,
                                                                                          len(test_y) // n))]
    folder = args.runs / name.replace(" ", "-")
    sinks = [StdoutSink(10, f"{name:>24s} ")] if rank == 0 else []
    if rank == 0 and tensorboard_available():
        sinks.append(TensorBoardSink(folder))
    sinks = [GatherRanks(sinks)] if ctx else sinks
    profiler = args.profile_steps and StepProfiler(*parse_steps(args.profile_steps), folder / "profile", device, rank)
    closing = [h for h in (NvmlSampler.start(device), profiler) if h]
    lcfg = loop.LoopConfig(args.steps, n, 1, schedule=schedule_from_args(args))
    try:
        records = loop.run(trainer, batch, lcfg, sinks, device,
                           hooks=closing + [Evaluator(trainer, held_out, args.eval_every, args.steps)])
    finally:
        for c in sinks + closing:
            c.close()
    # load_cifar10 says which it returned only on stdout; the real training split has 50,000 images.
    return curves(records) | {"data": "CIFAR-10" if len(x) == 50_000 else "synthetic CIFAR-like data"}


def on_ranks(build: Callable[[argparse.Namespace, Any, str], Any], grid: GridConfig, args: argparse.Namespace,
             name: str) -> Run:
    """``train_images`` on ``grid.size`` spawned ranks, or torchrun's (gloo on CPU, NCCL with a GPU each), the
    trainer of each from ``build(args, ctx, name)``; rank 0's curves."""
    if "RANK" in os.environ:
        return _rank(build, grid, args, name)
    return spawn(_rank, grid.size, (build, grid, args, name), timeout_s=24 * 3600, capture=False)[0]


def _rank(build: Callable[[argparse.Namespace, Any, str], Any], grid: GridConfig, args: argparse.Namespace,
          name: str) -> Run:
    ctx = init_distributed(grid)
    with ctx.guard():
        run = train_images(build(args, ctx, name), args, name, ctx)
    close_distributed(ctx)
    return run


def compare(runs: dict[str, Run], png: Path, title: str, args: argparse.Namespace) -> None:
    """Each run's losses against the first's (one process): a table, the overlay ``png``, the curves beside it
    as JSON with the demo's settings."""
    ref = next(iter(runs.values()))["loss"]
    print(f"{'run':>24s} {'first loss':>11s} {'last loss':>10s} {'last val':>9s} {'max |diff| vs one process':>26s}")
    for name, r in runs.items():
        val = f"{r['val_loss'][-1]:9.5f}" if r.get("val_loss") else f"{'-':>9s}"
        diff = max(abs(a - b) for a, b in zip(r["loss"], ref, strict=True))
        print(f"{name:>24s} {r['loss'][0]:11.5f} {r['loss'][-1]:10.5f} {val} {diff:26.2e}")
    png.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    png.with_suffix(".json").write_text(json.dumps({"config": config, "runs": runs}, indent=1))
    print(f"wrote {png.with_suffix('.json')}", flush=True)
    plot_curves({name: r["loss"] for name, r in runs.items()}, png, title)
