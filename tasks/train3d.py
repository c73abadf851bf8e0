"""Train a model with tensor x pipeline x data parallelism at once (``nanotrain.parallel3d``).

    torchrun --nproc-per-node 8 -m tasks.train3d --tp 2 --pp 2 --dp 2 --schedule 1f1b --sp ...
    python -m tasks.train3d --tp 2 --pp 2 --dp 2 ...    # without torchrun: spawns tp x pp x dp local processes

Each pipeline stage's blocks are tensor-parallel over ``--tp`` ranks (``--sp``: sequence
parallelism), ``--pp`` ranks run the stages under ``--schedule``, and the whole is replicated
``--dp`` times, each replica on its slice of the global batch of ``--dp x --microbatches x
--micro-batch-size`` sequences (Tiny Shakespeare windows, the same on every rank). The grid
order (``--grid-order``, innermost first) decides which ranks are neighbours: the default
``tp-dp-pp`` keeps a TP group on consecutive ranks, so on one node. Global rank 0 logs.

``--plan auto`` lets ``nanotrain.parallel3d.planner`` choose tp, pp, dp, the micro-batch, the
schedule, recompute and the ZeRO stage (``--zero``) for ``--global-batch`` on the launched processes
(or ``--gpus``), from the stated ``--gpu-mem-gib``, ``--flops``, ``--tp-gbps`` and ``--link-gbps``;
it prints its table. ``--dtype``, ``--adam-bits`` and ``--offload`` it takes as given: they
change the numerics (or the host's work), and its memory model counts them.

Every rank trains its own leaves with nanotrain's AdamW through the data-parallel engine
(``data_parallel.DataParallelAdam``, as ``tasks.finetune --dp`` does): ``--zero 1`` shards the
optimizer state over the data-parallel group (the gradients summed whole, each rank updating its
shard, the new weights all-gathered), ``--zero 2`` reduce-scatters the gradients as well;
``--bucket-mb`` sizes the reductions; ``--adam-bits 8`` keeps AdamW's moments in 8 bits; ``--dtype
bf16`` computes in bf16 with fp32 master weights; ``--offload`` keeps masters and moments in host memory.

``--out DIR`` saves every ``--save-every`` steps and at the end in the sharded format
(``data_parallel.checkpoint``: every rank its pieces of the masters and moments); ``--resume``
continues the latest checkpoint there at any dp and ZeRO stage (and, with 32-bit moments, any tp and
pp), and ``--export HF_DIR`` writes the trained model as a Hugging Face folder for ``transformers``.
``--weights HF_DIR`` starts from a Hugging Face folder's weights (its config.json is the model), e.g.
a checkpoint of an older format converted by ``tasks.consolidate``.
Both take the newest checkpoint whose files match their SHA-256 (``SHA256SUMS``), saying so when
that is not the latest.

SIGTERM or Ctrl-C, to any rank, to torchrun or to this launcher (which passes it on), stops every
rank after the same step; with ``--out`` they save, and the processes end by that signal (exit
status 143 or 130: stopped early, not done; ``nanotrain.train.preempt``).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from nanotrain.models import model_spec, preset
from nanotrain.data import random_windows
from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.checkpoint import check_resumable, consolidate, restore_sharded, save_sharded
from nanotrain.distributed import GridConfig, SpawnError, close_distributed, init_distributed, parse_order, spawn
from nanotrain.distributed.spawn import Stopped
from nanotrain.flops import flops_per_token, peak_flops
from nanotrain.monitor import JsonlSink, StdoutSink
from nanotrain.optim import AdamConfig, OffloadConfig
from nanotrain.parallel3d import Parallel3D, Parallel3DTrainer, build_3d
from nanotrain.parallel3d.planner import GIB, Hardware, Training, format_plan, plan
from nanotrain.pipeline import SCHEDULES, build_schedule
from nanotrain.pipeline.layered import describe
from nanotrain.train import loop
from nanotrain.train.loop import LoopConfig
from nanotrain.train.preempt import StopRequest, exit_by
from nanotrain.train.run_dir import find_checkpoint
from nanotrain.tokenizer import ByteTokenizer, TokenizerError, get_tokenizer
from weights import load_weights, read_config
from weights.safetensors_io import CheckpointError

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def fail(message: str) -> None:
    """A one-line error and exit status 2, the tasks' convention for bad input."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tasks.train3d", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    p.add_argument("--pp", type=int, default=1, help="pipeline ranks")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    p.add_argument("--virtual-stages", type=int, default=2, help="stages per pipeline rank (interleaved-1f1b)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism inside each TP group")
    p.add_argument("--grid-order", default="tp-dp-pp", help="grid axes, innermost (adjacent ranks) first")
    p.add_argument("--recompute", action="store_true", help="recompute each block in backward (keep its input only)")
    p.add_argument("--sublayers", action="store_true", help="attention and MLP as separate pipeline layers")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per replica and step")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--zero", type=int, choices=(0, 1, 2), default=0,
                   help="1: shard the optimizer state over dp; 2: reduce-scatter the gradients too")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="fp32 gradient megabytes per data-parallel reduction")
    p.add_argument("--adam-bits", type=int, choices=(32, 8), default=32, help="bits of AdamW's moments")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype (bf16: fp32 masters)")
    p.add_argument("--offload", action="store_true", help="masters and moments in host memory")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny", help="model preset (tiny, gpt2, gpt2-medium, ...)")
    p.add_argument("--n-layer", type=int, default=0, help="blocks (0: the preset's)")
    p.add_argument("--weights", type=Path, default=None,
                   help="start from this Hugging Face folder's weights; its config.json replaces --model and --n-layer")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--tokenizer", choices=("gpt2", "bytes"), default="gpt2")
    p.add_argument("--tokenizer-dir", type=Path, default=SHARED_DATA / "gpt2-tokenizer",
                   help="GPT-2's vocab.bpe and encoder.json (read offline)")
    p.add_argument("--data", type=Path, default=SHARED_DATA / "tinyshakespeare.txt")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--jsonl", type=Path, default=None, help="also write one JSON record per step here")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any rank may wait on another")
    p.add_argument("--out", type=Path, default=None, help="checkpoint folder (saved at the end and every --save-every)")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--export", type=Path, default=None, help="write the model here, HF layout (needs --out)")
    p.add_argument("--plan", choices=("manual", "auto"), default="manual",
                   help="auto: the planner picks --tp/--pp/--dp/--micro-batch-size/--schedule/--recompute/--zero")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step (--plan auto)")
    p.add_argument("--gpus", type=int, default=0, help="processes to plan for without torchrun (--plan auto)")
    p.add_argument("--gpu-mem-gib", type=float, default=80.0, help="memory per GPU (--plan auto)")
    p.add_argument("--flops", type=float, default=None, help="assumed sustained FLOP/s (in --dtype) per GPU or process "
                   "(--plan auto; default 5e13 with CUDA, 2e10 without): measure yours with tasks.bench.model")
    p.add_argument("--tp-gbps", type=float, default=100.0, help="assumed GB/s per GPU in TP collectives (--plan auto)")
    p.add_argument("--link-gbps", type=float, default=25.0, help="assumed GB/s of PP and DP traffic (--plan auto)")
    p.add_argument("--layer-overhead-ms", type=float, default=0.0,
                   help="fixed ms per layer and pipeline action, launches and waits (--plan auto): fit it and "
                        "--flops to two 1-GPU runs at different micro-batches (docs/BENCHMARKS.md, issue 19)")
    args = p.parse_args(argv)
    try:
        args.grid = GridConfig(args.tp, args.dp, args.pp, parse_order(args.grid_order))
    except ValueError as e:
        p.exit(2, f"error: {e}\n")
    if (args.resume or args.export) and args.out is None:
        p.exit(2, "error: --resume and --export read the checkpoints in --out; pass --out DIR\n")
    return args


def model_config(args: argparse.Namespace) -> Any:
    overrides = {"vocab_size": 256} if args.tokenizer == "bytes" else {}
    try:
        cfg = read_config(args.weights) if args.weights else preset(args.model, **overrides, **(
            {"n_layer": args.n_layer} if args.n_layer else {}))
    except CheckpointError as e:
        fail(str(e))
    n_ctx = model_spec(cfg).n_ctx
    if args.seq > n_ctx:
        fail(f"--seq {args.seq} exceeds {args.model}'s context of {n_ctx}; use --seq {n_ctx}")
    return cfg


def auto_layout(args: argparse.Namespace, world: int, show: bool) -> None:
    """Replace the layout flags by the planner's pick for ``world`` processes."""
    cfg = model_config(args)
    flops = args.flops or (5e13 if torch.cuda.is_available() else 2e10)
    hw = Hardware(world, args.gpu_mem_gib * GIB, flops, args.tp_gbps * 1e9, args.link_gbps * 1e9,
                  layer_overhead_s=args.layer_overhead_ms / 1e3)
    training = Training(2 if args.dtype == "bf16" else 4, args.adam_bits, args.offload)  # given, not planned
    try:
        preds = plan(cfg, args.seq, hw, args.global_batch, training)
    except ValueError as e:
        fail(str(e))
    if show:
        print(format_plan(preds, args.seq, args.global_batch), flush=True)
    if not preds[0].fits:
        fail(f"no layout of {args.model} fits {args.gpu_mem_gib} GiB per GPU; raise --gpu-mem-gib or use more GPUs")
    lay = preds[0].layout
    args.tp, args.pp, args.dp, args.micro_batch_size, args.microbatches = lay.tp, lay.pp, lay.dp, lay.micro_batch, \
        lay.n_micro
    args.schedule, args.recompute, args.sp, args.zero = lay.schedule, lay.recompute, lay.sequence_parallel, lay.zero
    args.grid = GridConfig(lay.tp, lay.dp, lay.pp, args.grid.order)
    if show:
        print(f"picked tp {lay.tp} x pp {lay.pp} x dp {lay.dp}, {lay.n_micro} micro-batches of {lay.micro_batch}, "
              f"{lay.schedule}{', recompute' if lay.recompute else ''}{f', ZeRO-{lay.zero}' if lay.zero else ''}: "
              f"{preds[0].step_s:.4f} s per step predicted, "
              f"{preds[0].mem_bytes / GIB:.2f} GiB per GPU", flush=True)


def load_corpus(args: argparse.Namespace) -> torch.Tensor:
    """The text as int64 token ids: GPT-2 BPE, or UTF-8 bytes (vocabulary 256)."""
    try:
        tok = ByteTokenizer() if args.tokenizer == "bytes" else get_tokenizer(str(args.tokenizer_dir))
    except TokenizerError as e:
        fail(f"{e} (or use --tokenizer bytes)")
    return torch.tensor(tok.encode_ordinary(args.data.read_text(encoding="utf-8")), dtype=torch.int64)


def make_trainer(args: argparse.Namespace, p3d: Parallel3D, dtype: torch.dtype) -> Parallel3DTrainer:
    """nanotrain's AdamW on every rank's leaves, through the data-parallel engine (``--zero``, ``--bucket-mb``)."""
    ocfg = OffloadConfig(device=str(p3d.pipe.ctx.device), dtype=dtype, offload=args.offload, state_bits=args.adam_bits)
    return Parallel3DTrainer(p3d, AdamConfig(lr=args.lr, weight_decay=0.01), ocfg,
                             DPConfig(zero=args.zero, bucket_mb=args.bucket_mb))


def run(args: argparse.Namespace) -> list[dict]:
    """This process's part of the run; the loop's records (on every rank)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    # Caught from the start, so that no signal interrupts a rank mid-collective: the loop stops every rank
    # at the same step boundary (before the first step if the signal came during setup).
    with StopRequest(announce=os.environ.get("RANK", "0") == "0") as stop:
        records = _run(args, stop)
    if stop.signal is not None and (not records or records[-1]["step"] < args.steps):
        stop.exit_if_stopped()  # by the signal, not 0: the run is not done
    return records


def _run(args: argparse.Namespace, stop: StopRequest) -> list[dict]:
    ctx = init_distributed(args.grid, timeout_s=args.timeout)
    cfg, corpus = model_config(args), load_corpus(args)
    batch = args.dp * args.microbatches * args.micro_batch_size
    with ctx.guard():
        schedule = build_schedule(args.schedule, args.pp, args.microbatches, args.virtual_stages)
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        weights = load_weights(cfg, str(args.weights)) if args.weights and not args.resume else None
        p3d = build_3d(ctx, cfg, schedule, args.seq, args.micro_batch_size, args.sp, args.sublayers, args.recompute,
                       seed=args.seed, dtype=dtype, weights=weights)
        del weights
        lead = ctx.rank == 0
        if lead:
            print(f"tp {args.tp} x pp {args.pp} x dp {args.dp} ({'-'.join(args.grid.order)}), {args.schedule}, "
                  f"global batch {batch} x {args.seq} tokens\n{describe(p3d.pipe.specs)}", flush=True)
        trainer = make_trainer(args, p3d, dtype)
        if args.resume:
            ckpt = args.ckpt  # resolved (and verified) once by the launcher; under torchrun by each rank
            restore_sharded(trainer, ckpt)
            if lead:
                print(f"resumed {ckpt} at step {trainer.step_count}", flush=True)
        device = ctx.device
        peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        lcfg = LoopConfig(steps=args.steps, sequences_per_step=batch, seq_len=args.seq,
                          flops_per_token=flops_per_token(cfg, args.seq), peak_flops=peak and peak * ctx.world_size)
        sinks = ([StdoutSink(args.log_every)] + ([JsonlSink(args.jsonl)] if args.jsonl else [])) if lead else []

        def save() -> Path | None:
            path = save_sharded(args.out, trainer)  # every rank writes its pieces; the first names the folder
            return path if lead else None

        records = loop.run(trainer, lambda: random_windows(corpus, args.seq, batch, args.seed, trainer.step_count),
                           lcfg, sinks, device, save if args.out else None, stop=stop,
                           phase=lambda what: setattr(ctx, "where", what))
        for sink in sinks:
            sink.close()
        stopped = stop.signal is not None and trainer.step_count < args.steps
        if stopped and lead:
            print(f"stopped by {stop.name} at step {trainer.step_count} of {args.steps}"
                  + (f", saved in {args.out}; continue with --resume" if args.out and records else ""), flush=True)
        if args.export and lead and not stopped:
            print(f"exported {consolidate(resumable(args), None, args.export)}", flush=True)
    close_distributed(ctx)
    return records


def resumable(args: argparse.Namespace) -> Path:
    """The newest checkpoint in --out whose files match their SHA-256 (a line when it is not the latest)."""
    try:
        found = find_checkpoint(args.out)
    except CheckpointError as e:
        fail(str(e))
    if found.note and os.environ.get("RANK", "0") == "0":
        print(f"warning: {found.note}", flush=True)
    return found.path


def main(argv: list[str] | None = None) -> None:
    try:
        launch(argv)
    except KeyboardInterrupt:  # Ctrl-C before the ranks took over signals (they stop at a step boundary)
        print("\nSIGINT before the run started: nothing trained, nothing to save", file=sys.stderr, flush=True)
        exit_by(signal.SIGINT)


def launch(argv: list[str] | None) -> None:
    args = parse_args(argv)
    if not args.data.is_file():
        fail(f"--data {args.data} does not exist; pass a text file")
    if args.plan == "auto":  # a pure function of the flags: every rank picks the same layout
        launched = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else args.gpus or args.grid.size
        auto_layout(args, launched, show=int(os.environ.get("RANK", "0")) == 0)
    check_stages(args, model_config(args))  # bad input fails here, once, not on every rank
    args.ckpt = None
    if args.resume:
        args.ckpt = resumable(args)
        check_resume(args, model_config(args))
    world = args.grid.size
    if "RANK" in os.environ:  # under torchrun
        launched = int(os.environ["WORLD_SIZE"])
        if launched != world:
            fail(f"--tp {args.tp} x --pp {args.pp} x --dp {args.dp} = {world} ranks, but torchrun started {launched} "
                 f"processes; make the product {launched} or launch {world}")
        run(args)
        return
    try:
        spawn(run, world, (args,), timeout_s=24 * 3600, capture=False)
    except Stopped as e:  # the ranks stopped early by a signal (passed on from here): end as they did
        exit_by(e.signal)
    except SpawnError as e:
        fail(f"the {world} processes stopped with exit codes {e.exit_codes}; their messages are above")


def check_resume(args: argparse.Namespace, cfg: Any) -> None:
    """The checkpoint to resume (``args.ckpt``), checked once before any process starts: its format, its model,
    and 8-bit moments' cut."""
    ckpt = args.ckpt
    try:
        check_resumable(ckpt, args.tp, OffloadConfig().block if args.adam_bits == 8 else None)
        if model_spec(read_config(ckpt)).shapes != model_spec(cfg).shapes:
            fail(f"{ckpt} holds another model than --model {args.model} makes; resume with the run's model flags")
    except CheckpointError as e:
        fail(str(e))


def check_stages(args: argparse.Namespace, cfg: Any) -> None:
    """The schedule and the split, checked once before any process starts."""
    try:
        stages = build_schedule(args.schedule, args.pp, args.microbatches, args.virtual_stages).n_stages
    except ValueError as e:
        fail(str(e))
    layers = model_spec(cfg).n_layer * (2 if args.sublayers else 1)
    if layers < stages:
        fail(f"{args.model} has {layers} layers to split but --pp {args.pp} with {args.schedule} makes {stages} "
             f"stages; pass --n-layer {stages} (or more), fewer --pp, or another schedule")


if __name__ == "__main__":
    main()
