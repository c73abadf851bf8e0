"""Train with pipeline parallelism and check it converges exactly like one process.

Trains a GPT-2 preset on Tiny Shakespeare (``--task gpt2``) through the one run path, ``tasks.finetune --pp
STAGES --schedule S``, once per requested schedule and once in one process, each into its run folder
(``OUT/<schedule>``, ``OUT/single-process``: metrics, loss curve, dashboard); or a CNN on CIFAR-10 (``--task
cnn``; a synthetic stand-in when torchvision or the data is missing) on ``nanotrain.pipeline``'s schedules.
The curves go overlaid to ``OUT/<task>_loss.png``, and beside it as JSON.

The defaults are a demo that takes about a minute on a laptop CPU (4 processes, 20 steps of 8
micro-batches of 1 x 32 tokens, every schedule, then the single process); the run in
docs/BENCHMARKS.md is ``--steps 60 --micro-batch-size 4 --seq 64`` (several minutes).

Launch, all with the same arguments:

    python -m tasks.pipeline --stages 4 ...                        # spawns 4 local processes
    torchrun --nproc-per-node 4 -m tasks.pipeline --stages 4 ...   # one node under torchrun
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        --rdzv-id JOB -m tasks.pipeline --stages 8 ...             # on every node

Processes use NCCL with one GPU each when CUDA is available, else gloo on CPU. Under torchrun
rank 0 runs the single-process reference after the pipeline run and writes the results.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from nanotrain.run import toml_config
from tasks.demos.cifar import cnn_loss, make_cnn_layers
from nanotrain.distributed import GridConfig
from nanotrain.pipeline import SCHEDULES, build_pipeline, build_schedule, reference_loss
from tasks.demos.pipeline_sequential import sequential_layered
from nanotrain.pipeline.build import materialize
from nanotrain.pipeline.layered import describe
from tasks.demos.adapters import AutogradTrainer, PipelineTrainer
from nanotrain.core.tree import named_leaves
from tasks.demos import loop as demo
SPLIT = ("shape only each stage's speed, not the losses this demo compares: time stage splits with "
         "tasks.bench.pipeline --balance measured|flops")
GONE = {"--balance": SPLIT, "--split": SPLIT, "--timeout": "is gone: the runs wait as tasks.finetune's do",
        "--clip-norm": "is not built for tasks.finetune --pp, which this demo runs: clip in one process or --dp",
        "--dtype": "is gone: the demo trains in fp32 (tasks.finetune --pp --dtype bf16 trains in bf16)"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tasks.pipeline", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("gpt2", "cnn"), default="gpt2")
    p.add_argument("--schedule", default="all", help=f"comma-separated, or 'all': {', '.join(SCHEDULES)}")
    p.add_argument("--stages", "--pp", type=int, default=4, help="pipeline ranks (processes); stages = ranks x "
                                                                "--virtual-stages for interleaved-1f1b")
    p.add_argument("--virtual-stages", "--virtual", type=int, default=2,
                   help="stages per rank for interleaved-1f1b (under torchrun spell it out: torchrun takes --virtual, "
                        "its old name, for an abbreviation of its own --virtual-local-rank)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=1)
    demo.add_args(p, GONE)
    p.add_argument("--model", default="tiny", help="model preset (tiny, gpt2, gpt2-medium, ...)")
    p.add_argument("--n-layer", type=int, default=8, help="blocks (0: the preset's); at least the stage count")
    p.add_argument("--seq", type=int, default=32, help="sequence length")
    p.add_argument("--out", type=Path, default=Path("runs/pipeline"))
    p.set_defaults(steps=20)
    args = toml_config.parse_args(p, argv)  # --config run.toml under the command line
    demo.check(p, args, {"--steps": args.steps, "--stages": args.stages, "--microbatches": args.microbatches,
                          "--micro-batch-size": args.micro_batch_size, "--seq": args.seq}, args.task == "cnn")
    args.schedules = list(SCHEDULES) if args.schedule == "all" else args.schedule.split(",")
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown:
        p.error(f"unknown schedule {unknown[0]!r} (known: {', '.join(SCHEDULES)}, or all)")
    if "RANK" in os.environ and int(os.environ["WORLD_SIZE"]) != args.stages:
        p.error(f"--stages {args.stages} but torchrun started {os.environ['WORLD_SIZE']} processes; pass --stages "
                f"{os.environ['WORLD_SIZE']}")
    args.batch, args.runs = args.microbatches * args.micro_batch_size, args.out
    return args


def language_model(args: argparse.Namespace) -> dict[str, demo.Run]:
    """Each schedule's run and the single process's, through tasks.finetune (rank 0's curves; others' empty)."""
    flags = demo.lm_flags(args) + ["--batch", str(args.batch), "--micro-batch", str(args.micro_batch_size),
                                    "--dtype", "fp32", "--data", demo.text_data(args, args.out)]
    flags += ["--n-layer", str(args.n_layer)] if args.n_layer else []
    runs = {name: demo.run_path(flags + ["--pp", str(args.stages), "--schedule", name, "--virtual-stages",
                                          str(args.virtual_stages)], args.out / name) for name in args.schedules}
    if int(os.environ.get("RANK", 0)):
        return {}
    return {"single process": demo.run_path(flags, args.out / "single-process"), **runs}


def cnn_trainer(args: argparse.Namespace, ctx: Any, name: str) -> AutogradTrainer:
    """The CNN's trainer: this rank's stages under schedule ``name``, or (no ``ctx``) the whole model."""
    model = sequential_layered(make_cnn_layers(), cnn_loss)
    if ctx is None:
        params = materialize(model, set(model.shapes), args.seed, torch.device("cpu"), torch.float32)
        leaves = [t for _, t in named_leaves(params) if isinstance(t, torch.Tensor)]
        return AutogradTrainer(params, lambda x, y: reference_loss(model, params, x, y),
                               torch.optim.AdamW(leaves, lr=args.lr))
    schedule = build_schedule(name, ctx.world_size, args.microbatches, args.virtual_stages)
    pipe = build_pipeline(ctx, model, schedule, torch.zeros(args.micro_batch_size, 3, 32, 32), None, args.seed)
    if ctx.rank == 0:
        print(f"{name}:\n{describe(pipe.specs)}", flush=True)
    return PipelineTrainer(pipe, torch.optim.AdamW(pipe.parameters(), lr=args.lr), args.microbatches)


def cnn(args: argparse.Namespace) -> dict[str, demo.Run]:
    runs = {name: demo.on_ranks(cnn_trainer, GridConfig(pp=args.stages), args, name) for name in args.schedules}
    if int(os.environ.get("RANK", 0)):
        return {}
    return {"single process": demo.train_images(cnn_trainer(args, None, ""), args, "single process"), **runs}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs = language_model(args) if args.task == "gpt2" else cnn(args)
    if runs:
        demo.compare(runs, args.out / f"{args.task}_loss.png", f"{args.task}: {args.stages} ranks, "
                      f"{args.microbatches} micro-batches of {args.micro_batch_size}", args)


if __name__ == "__main__":
    main()
