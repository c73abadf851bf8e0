"""Train with tensor parallelism and plot the learning curve beside single-process training.

    python -m tasks.tensor_parallel --model tiny --tp 2 --sp --steps 200
    python -m tasks.tensor_parallel --model tiny --tp 3 --sp --tp-overlap --steps 50
    python -m tasks.tensor_parallel --model tiny --tp 2 --sp --compile --steps 50
    python -m tasks.tensor_parallel --model mlp --tp 4 --steps 300
    python -m tasks.tensor_parallel --model cnn --tp 2 --steps 100

A language model (``--model``: a preset, default ``tiny``) trains on a text corpus (default: tiny Shakespeare from
``../shared/data``) from the same safetensors weights in both runs; the MLP and CNN train on
CIFAR-10 (``nanotrain.cifar``: torchvision where it can download, else a synthetic stand-in of
ten learnable classes, said so on the plot). The reference runs in this process, the TP ranks are
spawned (gloo on CPU, NCCL with one GPU each); both see the same batches, dropout masks and
initial weights, so the curves should lie on each other until rounding differences grow.
Writes ``--out`` (PNG) and the losses beside it as JSON, and both runs' dashboards (TensorBoard)
in ``<out>_tensorboard/``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from nanotrain.cifar import load_cifar10, normalize
from nanotrain import toml_config
from nanotrain.cli import tokenizer_dir
from nanotrain import models
from nanotrain.models import PRESETS, model_spec, preset
from nanotrain.data import BlockLoader, load_tokens, split_tokens
from nanotrain.tensor_parallel.shard import kv_replicas
from nanotrain.tensor_parallel import (GridConfig, RankGrid, build_grid, grad_norm, parallel_loss,
                                       parallelize_sequential, plan_tp, shard_params, sync_grads)
from nanotrain.distributed import run_in_group, spawn
from nanotrain.monitor import GatherRanks, StdoutSink, TensorBoardSink, tensorboard_available
from nanotrain.tokenizer import ByteTokenizer, TokenizerError, get_tokenizer
from nanotrain.train import loop
from nanotrain.train.adapters import AutogradTrainer
from nanotrain.train.evaluate import Evaluator, add_eval_args
from nanotrain.train.loop import LoopConfig
from nanotrain.train.scaler import LossScaler
from nanotrain.train.schedule import add_schedule_args, schedule_from_args
from nanotrain.tree import named_leaves, tree_map
from weights import CheckpointError, load_weights

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
VISION = ("mlp", "cnn")  # --model: these, or a language model preset


# ---------------------------------------------------------------------------------------------
# Data: the same batches in every process, from a seed.


def cifar10(root: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """Normalised train images and labels, test images and labels, and the source's name."""
    (x, y), (x_test, y_test) = load_cifar10(root, train=True), load_cifar10(root, train=False)
    # load_cifar10 says which it returned only on stdout; the real training split has 50,000 images.
    source = "CIFAR-10" if len(x) == 50_000 else "synthetic CIFAR-like data (no torchvision or no download)"
    return normalize(x), y, normalize(x_test), y_test, source


def vision_batches(x: torch.Tensor, y: torch.Tensor, batch: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (batch,), generator=g)
        yield x[idx], y[idx]


Batches = list[tuple[torch.Tensor, torch.Tensor]]


def text_batches(args, vocab: int) -> tuple[Batches, Batches]:
    """Each step's batch, and the held-out batches (``--val-fraction``; none without it). A model whose
    vocabulary cannot hold GPT-2's BPE (the tiny test presets) reads the text as UTF-8 bytes."""
    tok = get_tokenizer(tokenizer_dir(args.tokenizer_dir)) if vocab >= 50257 else ByteTokenizer()
    tokens, val = load_tokens(args.data, tok), None
    if args.val_fraction:
        tokens, val = split_tokens(tokens, args.val_fraction)
    loader = BlockLoader(tokens, args.seq, args.batch, seed=args.seed)
    held_out = [] if val is None else BlockLoader(val, args.seq, args.batch, seed=args.seed)
    return ([loader.next_batch() for _ in range(args.steps)],
            [held_out.next_batch() for _ in range(args.eval_batches)] if held_out else [])


# ---------------------------------------------------------------------------------------------
# Models and one training run each, single-process (group None) or tensor-parallel.


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


def train_vision(args, device: torch.device, group: dist.ProcessGroup | None) -> dict:
    x, y, x_test, y_test, source = cifar10(args.cifar_dir)
    torch.manual_seed(args.seed)
    net = vision_model(args.model)
    net = (net if group is None else parallelize_sequential(net, group)).to(device)
    batches = vision_batches(x, y, args.batch, args.steps, args.seed)

    def loss_fn(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(args.seed * 100003 + trainer.step_count)  # dropout masks: the same in every process
        return F.cross_entropy(net(xb.to(device)), yb.to(device))

    trainer = AutogradTrainer(dict(net.named_parameters()), loss_fn,
                              torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01))
    losses = [r["loss"] for r in train(trainer, lambda: next(batches), args, seq_len=1)]
    net.eval()
    with torch.no_grad():
        pred = torch.cat([net(xb.to(device)).argmax(-1).cpu() for xb in x_test[:2000].split(500)])
    return {"losses": losses, "test_accuracy": (pred == y_test[:2000]).float().mean().item(), "data": source}


def language_model(args) -> Any:
    """The preset's config, with ``--dropout`` on its dropout probabilities."""
    dropout = dict(embd_pdrop=args.dropout, attn_pdrop=args.dropout, resid_pdrop=args.dropout) if args.dropout else {}
    try:
        return preset(args.model, **dropout)
    except TypeError:
        raise ValueError(f"--dropout {args.dropout}: {args.model}'s config has no dropout probabilities") from None


def train_lm(args, device: torch.device, grid: RankGrid | None) -> dict:
    cfg = language_model(args)
    params = load_weights(cfg, args.weights, seed=args.seed)
    plan = None if grid is None else plan_tp(cfg, grid, sequence_parallel=args.sp, overlap=args.tp_overlap,
                                               compile="inductor" if args.compile else None)
    if plan is not None:
        params = shard_params(params, plan)
    params = tree_map(lambda t: t.to(device).requires_grad_(), params)
    steps, val = text_batches(args, model_spec(cfg).vocab_size)
    batches = iter(steps)

    def loss_fn(tokens: torch.Tensor, targets: torch.Tensor, dropout: bool = True) -> torch.Tensor:
        seed = args.seed * 100003 + trainer.step_count if args.dropout > 0 and dropout else None
        tokens, targets = tokens.to(device), targets.to(device)
        compute = tree_map(lambda t: t.half(), params) if args.dtype == "fp16" else params  # fp32 masters
        if plan is None:
            return models.loss(compute, tokens, targets, cfg, seed=seed)
        return parallel_loss(compute, tokens, targets, plan, seed=seed)

    opt = torch.optim.AdamW([t for _, t in named_leaves(params)], lr=args.lr, weight_decay=0.1)
    spread = plan is not None  # the gradients are finished, and their norm taken, over the TP group
    trainer = AutogradTrainer(params, loss_fn, opt, cfg, after_backward=(lambda: sync_grads(params, plan)) if spread
                              else None, eval_fn=lambda x, y: loss_fn(x, y, dropout=False), clip_norm=args.clip_norm,
                              norm_fn=(lambda: grad_norm(params, plan)) if spread else None,
                              scaler=LossScaler() if args.dtype == "fp16" else None)
    records = train(trainer, lambda: next(batches), args, seq_len=args.seq, val=val)
    return {"losses": [r["loss"] for r in records], "data": Path(args.data).name,
            "val_losses": [r["val_loss"] for r in records if "val_loss" in r]}


def train(trainer: AutogradTrainer, next_batch, args, seq_len: int, val: list | None = None) -> list[dict]:
    """The one loop, printing every ``--log-every`` steps, validating on ``val``; the records. Under tensor
    parallelism every rank's records are gathered to rank 0, which writes the dashboard (``OUT_tensorboard/``)."""
    parallel = dist.is_initialized()
    sinks = [StdoutSink(args.log_every, "  ")] if args.log_every else []
    if tensorboard_available() and (not parallel or dist.get_rank() == 0):
        sinks.append(TensorBoardSink(Path(args.tensorboard_dir) / ("tensor_parallel" if parallel else "single")))
    sinks = [GatherRanks(sinks)] if parallel else sinks
    try:
        lcfg = LoopConfig(args.steps, args.batch, seq_len, schedule=schedule_from_args(args))
        hooks = [Evaluator(trainer, val, args.eval_every, args.steps)] if val else []
        records = loop.run(trainer, next_batch, lcfg, sinks, torch.device("cpu"), hooks=hooks)
    finally:
        for sink in sinks:
            sink.close()
    return records


def run(args, device: torch.device, grid: RankGrid | None) -> dict:
    """One training run: single process with ``grid=None``, else this rank's share of the TP run."""
    if args.model not in VISION:
        return train_lm(args, device, grid)
    return train_vision(args, device, None if grid is None else grid.tp_group)


def _tp_rank(rank: int, world: int, args, result_path: str) -> None:
    grid = build_grid(GridConfig(tp=world))
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if rank:
        args.log_every = 0
    result = run(args, device, grid)
    if rank == 0:
        Path(result_path).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------


def plot(ref: dict, tp: dict, args, path: Path) -> None:
    import matplotlib  # lazily: plotting is optional

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(len(ref["losses"]))
    # Steps whose losses are bitwise equal have no point on the log scale; they are counted instead.
    diffs = [(i, abs(a - b)) for i, (a, b) in enumerate(zip(ref["losses"], tp["losses"]))]
    nonzero = [(i, d) for i, d in diffs if d > 0]
    fig, (ax, ax_diff) = plt.subplots(1, 2, figsize=(12, 4.5))
    what = args.model
    tp_name = (f"tensor parallel, {args.tp} ranks" + (" + sequence parallel" if args.sp else "")
               + (" (overlapped)" if args.tp_overlap else "") + (" (compiled)" if args.compile else ""))
    ax.plot(steps, ref["losses"], label="single process", lw=2.5, alpha=0.6)
    ax.plot(steps, tp["losses"], label=tp_name, lw=1, ls="--")
    ax.set(xlabel="step", ylabel="training loss", title=f"{what} on {ref['data']}")
    ax.legend()
    if nonzero:
        ax_diff.semilogy(*zip(*nonzero), ".")
    ax_diff.set(xlabel="step", ylabel="|loss difference|", xlim=ax.get_xlim(),
                title=f"tensor parallel vs single process ({len(diffs) - len(nonzero)} of {len(diffs)} steps equal)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help=f"{', '.join(VISION)} or a language model preset: "
                    f"{', '.join(PRESETS)}")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism (language models)")
    ap.add_argument("--tp-overlap", action="store_true", help="collectives travel while the matmuls compute: ring "
                    "steps with --sp, chunked and asynchronous all-reduces without (language models)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each TP block's local compute, the "
                    "collectives between the compiled regions (language models)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=None, help="default: 8 sequences, 128 images")
    ap.add_argument("--lr", type=float, default=None, help="default: 1e-3, 2e-3 for the cnn")
    add_schedule_args(ap)
    ap.add_argument("--clip-norm", type=float, default=None,
                    help="clip gradients to this global norm (language models)")
    ap.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32",
                    help="a language model's compute dtype; fp16 (fp32 masters) scales the loss dynamically, as "
                         "GradScaler")
    add_eval_args(ap, val_data=False)
    ap.add_argument("--weights", default="random", help="language model weights: random, hub or a model.safetensors "
                    "path")
    ap.add_argument("--seq", type=int, default=64, help="language model sequence length")
    ap.add_argument("--dropout", type=float, default=0.0, help="language model dropout (masks are seeded, so still "
                    "exact)")
    ap.add_argument("--data", default=str(SHARED / "tinyshakespeare.txt"), help="language model text corpus")
    ap.add_argument("--tokenizer-dir", default=str(SHARED / "gpt2-tokenizer") if (SHARED / "gpt2-tokenizer").is_dir()
                    else None, help="folder with GPT-2's vocab.bpe and encoder.json (offline)")
    ap.add_argument("--cifar-dir", default=".cache/cifar10")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--out", default=None, help="PNG path (default runs/tensor_parallel/<model>_tp<N>[_sp].png)")
    args = toml_config.parse_args(ap, argv)  # --config run.toml under the command line
    args.batch = args.batch or (128 if args.model in VISION else 8)
    args.lr = args.lr or (2e-3 if args.model == "cnn" else 1e-3)
    if (args.sp or args.tp_overlap or args.compile) and args.model in VISION:
        sys.exit("error: --sp, --tp-overlap and --compile apply to language models only")
    if args.tp < 1:
        sys.exit(f"error: --tp {args.tp} must be at least 1")
    try:
        schedule_from_args(args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if (args.val_fraction or args.eval_every or args.clip_norm or args.dtype != "fp32") and args.model in VISION:
        sys.exit("error: --val-fraction, --eval-every, --clip-norm and --dtype apply to language models (the vision "
                 "models report test accuracy, and their sharded layers have no norm rule yet)")
    if args.eval_every and not args.val_fraction:
        sys.exit(f"error: --eval-every {args.eval_every} needs held-out data: add --val-fraction 0.05")
    if args.model not in VISION:  # a cut the model cannot take is refused before any process starts
        try:
            kv_replicas(model_spec(language_model(args)), args.tp)
        except ValueError as e:
            sys.exit(f"error: {e}")
    out = Path(args.out or f"runs/tensor_parallel/{args.model}_tp{args.tp}{'_sp' if args.sp else ''}"
               f"{'_overlap' if args.tp_overlap else ''}{'_compiled' if args.compile else ''}.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    args.tensorboard_dir = str(out.with_name(out.stem + "_tensorboard"))
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    try:
        print(f"single process, {args.model}", flush=True)
        ref = run(args, device, None)
        print(f"tensor parallel, {args.tp} ranks{' + sequence parallel' if args.sp else ''}"
              f"{' (overlapped)' if args.tp_overlap else ''}{' (compiled)' if args.compile else ''}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "rank0.json"
            spawn(run_in_group, args.tp, ("nccl" if args.device == "cuda" else "gloo", _tp_rank, args, str(result)),
                  timeout_s=24 * 3600, capture=False)
            tp = json.loads(result.read_text())
    except (TokenizerError, CheckpointError, FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    diffs = [abs(a - b) for a, b in zip(ref["losses"], tp["losses"])]
    first = min(10, len(diffs))
    print(f"data: {ref['data']}")
    print(f"final loss: single {ref['losses'][-1]:.5f}, tensor parallel {tp['losses'][-1]:.5f}; "
          f"max |difference| over the first {first} steps {max(diffs[:first]):.2e}, over all {max(diffs):.2e}")
    if ref.get("val_losses"):
        print(f"validation loss: single {ref['val_losses'][-1]:.5f}, tensor parallel {tp['val_losses'][-1]:.5f}")
    if "test_accuracy" in ref:
        print(f"test accuracy (2000 images): single {ref['test_accuracy']:.3f}, "
              f"tensor parallel {tp['test_accuracy']:.3f}")
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "single": ref, "tensor_parallel": tp},
                                                   indent=1))
    plot(ref, tp, args, out)
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
