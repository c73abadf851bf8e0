"""Train with tensor parallelism and plot the learning curve beside single-process training.

    python -m tasks.tensor_parallel --model tiny --tp 2 --sp --steps 200
    python -m tasks.tensor_parallel --model tiny --tp 3 --sp --tp-overlap --steps 50
    python -m tasks.tensor_parallel --model mlp --tp 4 --steps 300
    python -m tasks.tensor_parallel --model cnn --tp 2 --steps 100

A language model (``--model``: a preset, default ``tiny``) trains on a text corpus (default: tiny Shakespeare from
``../shared/data``) through the one run path, ``tasks.finetune --tp N`` and the same in one process, from the same
weights (``--weights``). The MLP and CNN train on CIFAR-10 (``tasks.demos.cifar``: torchvision where it can
download, else a synthetic stand-in of ten learnable classes, said so on the plot) as ``nn.Sequential`` models
cut by ``parallelize_sequential``. The TP ranks are spawned (gloo on CPU, NCCL with one GPU each); both runs see
the same batches and initial weights (and the CNN the same dropout masks), so the curves should lie on each other
until rounding differences grow. Writes ``--out`` (PNG), the curves beside it as JSON, and each run's folder (metrics,
dashboard) in ``<out without .png>/``.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanotrain.run import toml_config
from nanotrain.distributed import GridConfig
from nanotrain.core.models import PRESETS
from tasks.demos.tp_sequential import parallelize_sequential
from tasks.demos.adapters import AutogradTrainer
from tasks.demos import loop as demo
VISION = ("mlp", "cnn")  # --model: these, or a language model preset
GONE = {"--compile": "is not built for tasks.finetune --tp, which this demo runs: time compiled tensor parallelism "
                     "with tasks.bench.tp --compile off,on",
        "--dropout": "is gone: tasks.finetune --tp trains models with dropout off (tests/tensor_parallel/test_tp_gpt2.py checks "
                     "dropout under tensor parallelism)",
        "--clip-norm": "is not built for tasks.finetune --tp, which this demo runs: clip in one process or --dp",
        "--dtype": "is gone: the demo trains in fp32 (tasks.finetune --tp --dtype bf16 trains in bf16)",
        "--device": "is gone: the ranks take a GPU each where CUDA is available (CUDA_VISIBLE_DEVICES= for the CPU)",
        "--log-every": "is gone: the language model's runs print every step, the CIFAR models' every 10th"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help=f"{', '.join(VISION)} or a language model preset: "
                    f"{', '.join(PRESETS)}")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism (language models)")
    ap.add_argument("--tp-overlap", action="store_true", help="collectives travel while the matmuls compute: ring "
                    "steps with --sp, chunked and asynchronous all-reduces without (language models)")
    ap.add_argument("--batch", type=int, default=None, help="default: 128 images, 8 sequences (with --sp, the "
                    "next multiple of --tp: its ranks split the tokens)")
    ap.add_argument("--weights", default="random", help="language model weights: random, hub or a model.safetensors "
                    "path")
    ap.add_argument("--seq", type=int, default=64, help="language model sequence length")
    ap.add_argument("--out", default=None, help="PNG path (default runs/tensor_parallel/<model>_tp<N>[_sp].png)")
    demo.add_args(ap, GONE)
    ap.set_defaults(steps=100)
    args = toml_config.parse_args(ap, argv)  # --config run.toml under the command line
    vision = args.model in VISION
    args.batch = args.batch or (128 if vision else -(-8 // args.tp) * args.tp if args.sp else 8)
    demo.check(ap, args, {"--tp": args.tp, "--steps": args.steps, "--batch": args.batch, "--seq": args.seq}, vision)
    if (args.sp or args.tp_overlap) and vision:
        ap.error("--sp and --tp-overlap apply to language models only")
    args.png = Path(args.out or f"runs/tensor_parallel/{args.model}_tp{args.tp}{'_sp' if args.sp else ''}"
                    f"{'_overlap' if args.tp_overlap else ''}.png")
    args.runs = args.png.with_suffix("")
    return args


def language_model(args: argparse.Namespace) -> dict[str, demo.Run]:
    flags = demo.lm_flags(args) + ["--batch", str(args.batch), "--weights", args.weights, "--dtype", "fp32",
                                    "--data", demo.text_data(args, args.runs)]
    parallel = flags + ["--tp", str(args.tp)] + ["--sp"] * args.sp + ["--tp-overlap"] * args.tp_overlap
    tp = demo.run_path(parallel, args.runs / "tensor-parallel")  # first: what it refuses, it refuses at once
    return {"single process": demo.run_path(flags, args.runs / "single-process"), "tensor parallel": tp}


def vision_model(kind: str) -> nn.Sequential:
    """Linear/Conv layers in pairs with featurewise layers between: each pair becomes column + row."""
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 512, bias=False), nn.BatchNorm1d(512), nn.ReLU(),
                             nn.Linear(512, 256), nn.LayerNorm(256), nn.ReLU(), nn.Linear(256, 10))
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 10))


def vision_trainer(args: argparse.Namespace, ctx: Any, name: str = "") -> AutogradTrainer:
    """The MLP's or CNN's trainer: this rank's tensor-parallel share, or (no ``ctx``) the whole model."""
    torch.manual_seed(args.seed)
    device = ctx.device if ctx else torch.device("cpu")
    net = (vision_model(args.model) if ctx is None else parallelize_sequential(vision_model(args.model),
                                                                               ctx.grid.tp_group)).to(device)

    def loss_fn(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(args.seed * 100003 + trainer.step_count)  # dropout masks: the same in every process
        return F.cross_entropy(net(xb.to(device)), yb.to(device))

    def eval_fn(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:  # batch norm's running statistics, no dropout
        net.eval()
        loss = F.cross_entropy(net(xb.to(device)), yb.to(device))
        net.train()
        return loss

    trainer = AutogradTrainer(dict(net.named_parameters()), loss_fn,
                              torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01), eval_fn=eval_fn)
    return trainer


def vision(args: argparse.Namespace) -> dict[str, demo.Run]:
    tp = demo.on_ranks(vision_trainer, GridConfig(tp=args.tp), args, "tensor parallel")
    return {"single process": demo.train_images(vision_trainer(args, None), args, "single process"),
            "tensor parallel": tp}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs = vision(args) if args.model in VISION else language_model(args)
    name = (f"tensor parallel, {args.tp} ranks" + (" + sequence parallel" if args.sp else "")
            + (" (overlapped)" if args.tp_overlap else ""))
    demo.compare(runs, args.png, f"{args.model}: {name} vs one process"
                  + (f", {runs['single process']['data']}" if "data" in runs["single process"] else ""), args)


if __name__ == "__main__":
    main()
