"""Fine-tune GPT-2 with AdamW under a GPU memory cap: the flagship job.

    python -m tasks.finetune --model gpt2-large --gpu-mem-gib 11 --batch 64 --seq 1024 --steps 30 --data stdlib
    python -m tasks.finetune --model tiny --batch 8 --seq 128 --steps 30 --data ../shared/data/tinyshakespeare.txt

Every parameter is updated every step from fp32 master weights; the optimizer state lives in CPU
memory (``--states cpu``, the default) or on the GPU (``--states gpu``, with ``--adam-bits 8`` to
fit). One line per step, metrics in ``OUT/metrics.jsonl``, the loss curve in ``OUT/loss.png``,
checkpoints in ``OUT/step-N`` (``--save-every``) that ``--resume`` continues exactly.

Weight streaming (``--stream``, or on its own when the model cannot fit the GPU cap otherwise):
weights, masters and moments stay in host memory and visit the GPU block by block
(``nanotrain.train.streamed``). ``--host-mem-gib`` checks the plan against a host budget before
anything is allocated, and the measured peak RSS after every step:

    python -m tasks.finetune --model gpt2-xl --gpu-mem-gib 11 --host-mem-gib 16 --adam-bits 8 --steps 30
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from nanotrain.memory.recompute import CheckpointPolicy
from nanotrain.cli import add_model_args, cuda_index, model_config, pick_device
from nanotrain.data_parallel import checkpoint as sharded, data_parallel_trainer, launch as dp
from nanotrain.data import BlockLoader, load_tokens
from nanotrain.flops import flops_per_token, peak_flops
from nanotrain.memory.plan import (CUDA_RUNTIME_BYTES, GIB, StreamPlan, choose_micro_batch, estimate, host_rss_gib,
                              plan_streaming, return_freed_memory_to_the_os, set_gpu_cap)
from nanotrain.optim import AdamConfig, OffloadConfig
from nanotrain.monitor import JsonlSink, StdoutSink, read_jsonl
from nanotrain.plot import plot_curves
from nanotrain.train import loop
from nanotrain.train.loop import LoopConfig
from nanotrain.tokenizer import TokenizerError, get_tokenizer
from nanotrain.train.state import latest_checkpoint, load_masters, restore, save_checkpoint
from nanotrain.train.streamed import StreamConfig, StreamTrainer
from nanotrain.train.resident import ResidentTrainer, TrainConfig
from nanotrain.train.step import EMBEDDINGS
from nanotrain.tree import set_path
from nanotrain import model as M
from weights import CheckpointError, load_weights


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, default_model="gpt2-large", default_weights="random")
    ap.add_argument("--data", default="stdlib", help="a text or .jsonl file, or 'stdlib' (Python's own sources)")
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
    ap.add_argument("--tail", type=int, default=0,
                    help="with --stream: the top N blocks run with the head, micro-batch by micro-batch, "
                         "without recompute")
    ap.add_argument("--tail-micro-batch", type=int, default=None, help="sequences per pass through the tail")
    ap.add_argument("--recompute", "--checkpoint", dest="recompute", default="none",
                    help="activation recompute policy (--checkpoint is its old name): none, lean, selective, every, "
                         "every-K")
    ap.add_argument("--adam-bits", type=int, default=32, choices=[32, 8])
    ap.add_argument("--states", default="cpu", choices=["cpu", "gpu"], help="where masters and moments live")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (--recompute none, or --stream)")
    ap.add_argument("--fixed-batch", action="store_true", help="train on the first batch every step")
    ap.add_argument("--out", type=Path, default=Path("runs/finetune"))
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/latest")
    dp.add_dp_args(ap)
    return ap.parse_args(argv)


def plan_micro_batch(args, cfg, device: torch.device, dtype: torch.dtype) -> int:
    policy = CheckpointPolicy.parse(args.recompute)
    batch = args.batch // args.dp  # each data-parallel rank's share
    if args.gpu_mem_gib is None or device.type != "cuda":
        return args.micro_batch or batch
    cap = int(args.gpu_mem_gib * GIB)
    set_gpu_cap(args.gpu_mem_gib, device)
    nbytes = torch.empty((), dtype=dtype).element_size()
    if args.micro_batch:
        plan = estimate(cfg, args.micro_batch, args.seq, policy, nbytes)
        if plan.total > cap:
            print(f"warning: the estimate for {plan.describe()} is above the {args.gpu_mem_gib} GiB cap", flush=True)
        return args.micro_batch
    plan = choose_micro_batch(cfg, batch, args.seq, policy, cap, nbytes)
    print(f"memory plan under {args.gpu_mem_gib} GiB: {plan.describe()}", flush=True)
    return plan.micro_batch


def plan_stream(args, cfg, device: torch.device, dtype: torch.dtype) -> StreamPlan:
    return_freed_memory_to_the_os()  # before loading: the host budget is counted in RSS
    if device.type != "cuda":
        micro = args.micro_batch or max(d for d in range(1, min(args.batch, 8) + 1) if args.batch % d == 0)
        return StreamPlan(micro, 0, 0, 0, "on the CPU: nothing to plan")
    gpu_cap = int((args.gpu_mem_gib or torch.cuda.get_device_properties(device).total_memory / GIB) * GIB)
    host_cap = None if args.host_mem_gib is None else int(args.host_mem_gib * GIB)
    base = int(host_rss_gib()[0] * GIB) + CUDA_RUNTIME_BYTES
    plan = plan_streaming(cfg, args.batch, args.seq, gpu_cap, host_cap, args.adam_bits,
                          torch.empty((), dtype=dtype).element_size(), args.micro_batch, base,
                          tail=args.tail, tail_mb=args.tail_micro_batch)
    if args.gpu_mem_gib is not None:
        set_gpu_cap(args.gpu_mem_gib, device)
    print(f"streaming plan: {plan.describe()}", flush=True)
    return plan


def train_config(args, micro: int, plan: StreamPlan | None) -> TrainConfig | StreamConfig:
    """The streaming trainer's configuration when there is a streaming plan, else the resident one's."""
    if plan is not None:
        return StreamConfig(args.batch, plan.micro_batch, plan.on_host, compile=args.compile, tail=args.tail,
                            tail_micro_batch=args.tail_micro_batch)
    return TrainConfig(batch=args.batch, micro_batch=micro, checkpoint=args.recompute, compile=args.compile)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        dp.check_dp_args(args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if dp.started_here(args, main, argv):
        return
    dp.resume_after_restart(args)
    ctx = dp.join(args)
    cfg = model_config(args.model)
    device = ctx.device if ctx else pick_device(args.device)
    if device.type == "cuda":
        device = cuda_index(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        tok = get_tokenizer(args.tokenizer_dir)
        tokens = load_tokens(args.data, tok)
        plan = None
        if not args.stream:
            try:
                micro = plan_micro_batch(args, cfg, device, dtype)
            except MemoryError as e:
                print(f"{e}\n-> streaming the weights instead", flush=True)
                args.stream = True
        if args.stream:  # refuse a plan that cannot fit before loading anything
            plan = plan_stream(args, cfg, device, dtype)
            micro = plan.micro_batch
        tcfg = train_config(args, micro, plan)  # bad settings fail here, before the weights load
        dp.check_split(args.batch, micro, args.dp)
        ckpt = latest_checkpoint(args.out) if args.resume else None
        if ckpt is not None:
            params = M.empty_tree(cfg)
            for path, t in (sharded.load_masters if sharded.is_sharded(ckpt) else load_masters)(ckpt).items():
                set_path(params, path, t)
        else:
            params = load_weights(args.weights, args.model, cfg, seed=args.seed)
    except (TokenizerError, CheckpointError, FileNotFoundError, ValueError, MemoryError) as e:
        sys.exit(f"error: {e}")
    ocfg = OffloadConfig(device=str(device), dtype=dtype, offload=args.states == "cpu", state_bits=args.adam_bits,
                         keep_32bit=EMBEDDINGS)
    adam = AdamConfig(lr=args.lr, weight_decay=args.weight_decay)
    try:
        if ctx:
            trainer = data_parallel_trainer(cfg, params, tcfg, adam, ocfg, dp.dp_config(args), ctx.grid.dp_group)
        else:
            trainer = (StreamTrainer if plan is not None else ResidentTrainer)(cfg, params, tcfg, adam, ocfg)
    except (ValueError, MemoryError) as e:
        sys.exit(f"error: {e}")
    del params
    loader = BlockLoader(tokens, args.seq, args.batch, seed=args.seed)
    if ckpt is not None:
        loader.position = (sharded.restore_any if sharded.is_sharded(ckpt) else restore)(trainer, ckpt)
        print(f"resumed from {ckpt} at step {trainer.step_count}", flush=True)
    fixed = loader.next_batch() if args.fixed_batch else None

    print(f"{args.model}: {cfg.num_params() / 1e6:.0f}M parameters, batch {args.batch} x {args.seq} as "
          f"{args.batch // micro} micro-batches of {micro}{dp.describe(args)}, "
          f"{'weights streamed block by block' if args.stream else f'recompute {args.recompute}'}, "
          f"{args.adam_bits}-bit Adam states "
          f"{'in host memory, updated on the device' if args.stream else f'on {args.states}'}, {dtype} compute on "
          f"{device}", flush=True)
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    lcfg = LoopConfig(steps=args.steps, sequences_per_step=args.batch, seq_len=args.seq,
                      flops_per_token=flops_per_token(cfg, args.seq),
                      peak_flops=peak and peak * args.dp,  # every rank's GPU works on the batch
                      save_every=args.save_every, host_mem_gib=args.host_mem_gib)
    first = ctx is None or ctx.rank == 0
    sinks = [StdoutSink(), JsonlSink(args.out / "metrics.jsonl")] if first else []
    save = lambda: save_checkpoint(args.out, trainer, loader.position, vars_json(args))  # noqa: E731
    if args.sharded_save:  # every rank writes its own shard
        save = lambda: sharded.save_sharded(args.out, trainer, loader.position, vars_json(args))  # noqa: E731
    elif not first:  # the others help gather the state that the first saves
        save = lambda: (trainer.state_dict(), args.out)[1]  # noqa: E731
    try:
        with dp.guard(ctx):
            loop.run(trainer, (lambda: fixed) if fixed is not None else loader.next_batch, lcfg, sinks, device,
                     save=save)
    except loop.HostMemoryExceeded as e:
        trainer.close()
        sys.exit(f"error: {e}")
    finally:
        for sink in sinks:
            sink.close()
    trainer.close()
    if ctx:
        dp.leave(ctx)
    if first:
        plot_run(args)


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
