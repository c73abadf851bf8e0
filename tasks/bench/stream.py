"""The fine-tuning job under a GPU memory cap beside its peers, in one run on one GPU.

    python -m tasks.bench --model gpt2-large --gpu-mem-gib 11 --out runs/bench.json
    python -m tasks.bench --model gpt2-xl --gpu-mem-gib 11 --host-mem-gib 16 --rows ours-plain,hf-plain,ours-stream

Rows (batch 64 x 1024 per optimizer step unless given otherwise, random weights of real shapes):
- ``ours plain``: our forward+backward at its best micro-batch, no cap, no optimizer (the ceiling);
- ``HF plain``: transformers' forward+backward, same conditions;
- ``HF ckpt + fused AdamW``: transformers with gradient checkpointing and torch's fused AdamW on
  the GPU, micro-batch 8 x 8, no cap: what a user without nanotrain would run on a big GPU;
- ``ours capped``: ``tasks.finetune``'s trainer, every parameter updated by AdamW each step,
  under the cap (``torch.cuda.set_per_process_memory_fraction``: an overshoot is an error);
- ``ours streamed``: ``tasks.finetune --stream`` (weights streamed block by block, 8-bit moments
  with ``--adam-bits 8``) under the GPU cap and the host cap;
- ``FSDP2 offload``: transformers' model under torch FSDP2 with ``CPUOffloadPolicy``, bf16
  mixed precision, gradient checkpointing, AdamW on the CPU, micro-batch 8 x 8, same cap.
Each row reports seq/s, tokens/s, MFU, peak GPU GiB and peak RSS. Our trainers run in a process
of their own (``tasks.finetune``), so their RSS is theirs alone; the in-process rows report the
bench process's. A row that fails prints its error and the others still run.
"""
from __future__ import annotations

import argparse
import os
import time
import traceback
from typing import Any

import torch

from nanotrain.core.machine import host_rss_gib, set_gpu_cap
from nanotrain.core.models import model_spec, preset
from nanotrain.monitor import read_jsonl
from tasks.bench.common import (Row, device_name, free_memory, need_cuda, peak_gib, print_table, reset_peak,
                                time_steps, write_json)
from tasks.bench.model import best_of, ours_step
from tasks.bench.peers.hf import fsdp2, hf_model, hf_step, hf_train_step


def reset_peak_rss() -> None:
    """Reset the kernel's high-water mark of this process's RSS (Linux: clear_refs 5)."""
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def finetune_row(name: str, cfg: Any, args, extra_argv: list[str]) -> Row:
    """``tasks.finetune`` on a fixed batch in a fresh process; the mean of the steps after warm-up."""
    import shutil
    import subprocess
    import sys

    out = f"/tmp/nanotrain-bench-{os.getpid()}-{len(extra_argv)}-{abs(hash(tuple(extra_argv)))}"
    argv = ["--model", args.model, "--gpu-mem-gib", str(args.gpu_mem_gib), "--batch", str(args.batch), "--seq",
            str(args.seq), "--steps", str(args.warmup + args.steps), "--weights", "random", "--data", args.data,
            "--out", out, "--fixed-batch", *extra_argv]
    if args.tokenizer_dir:
        argv += ["--tokenizer-dir", args.tokenizer_dir]
    if args.micro_batch:
        argv += ["--micro-batch", str(args.micro_batch)]
    try:
        subprocess.run([sys.executable, "-m", "tasks.finetune", *argv], check=True)
        rows = read_jsonl(f"{out}/metrics.jsonl")[args.warmup:]
    finally:
        shutil.rmtree(out, ignore_errors=True)  # its final checkpoint: 12 GB for gpt2-large, disks fill fast
    seconds = sum(r["step_s"] for r in rows) / len(rows)
    extra = {"peak_rss_gib": max(r["peak_rss_gib"] for r in rows), "losses": [r["loss"] for r in rows]}
    if "copy_wait_fraction" in rows[0]:
        extra["copy_wait_fraction"] = sum(r["copy_wait_fraction"] for r in rows) / len(rows)
    return Row.measured(name, cfg, args.batch, args.seq, seconds, max(r["peak_gpu_gib"] for r in rows), **extra)


def hf_trained(name: str, cfg: Any, args, fsdp2_offload: bool = False, mb: int = 8) -> Row:
    """transformers' model with gradient checkpointing trained on batches of ``args.batch`` as micro-batches of
    ``mb``: bf16 on the GPU with torch's fused AdamW, or under FSDP2 with CPU offload and AdamW on the CPU."""
    if fsdp2_offload:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29512", rank=0, world_size=1)
        model = fsdp2(hf_model(cfg, recompute=True), offload=True)
    else:
        model = hf_model(cfg, recompute=True).to(device="cuda", dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not fsdp2_offload)
    tokens = torch.randint(0, model_spec(cfg).vocab_size, (args.batch, args.seq))
    step = hf_train_step(model, opt, tokens, mb, torch.device("cuda"))
    reset_peak()
    dt = time_steps(step, args.warmup, args.steps)
    return Row.measured(name, cfg, args.batch, args.seq, dt, peak_gib(), micro_batch=mb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-large")
    ap.add_argument("--gpu-mem-gib", type=float, default=11.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--host-mem-gib", type=float, default=16.0, help="host cap of the streamed row")
    ap.add_argument("--adam-bits", type=int, default=8, choices=[8, 32], help="moments of the streamed row")
    ap.add_argument("--compile", action="store_true", help="torch.compile the blocks of the streamed row")
    ap.add_argument("--stream-args", default="", help="more tasks.finetune options for the streamed row, e.g. "
                                                     "'--tail 8 --tail-micro-batch 4'")
    ap.add_argument("--checkpoint", default="selective", help="policies of the capped rows, comma-separated")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--data", default="stdlib")
    ap.add_argument("--tokenizer-dir", default=None)
    ap.add_argument("--plain-micro-batches", default="8,16")
    ap.add_argument("--rows", default="ours-plain,hf-plain,ours-capped,fsdp2",
                    help="which rows, in this order: ours-plain, hf-plain, hf-ckpt-adam, ours-capped, ours-stream, "
                         "fsdp2")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    need_cuda("tasks.bench.stream")
    cfg = preset(args.model)
    mbs = [int(m) for m in args.plain_micro_batches.split(",")]
    runs = {
        "ours-plain": lambda: best_of("ours plain (no cap)", lambda m: ours_step(cfg, m, args.seq, False), cfg, mbs,
                                      args.seq, args.warmup, args.steps),
        "hf-plain": lambda: best_of("HF plain (no cap)", lambda m: hf_step(cfg, m, args.seq), cfg, mbs, args.seq,
                                    args.warmup, args.steps),
        "hf-ckpt-adam": lambda: hf_trained("HF ckpt + fused AdamW (bf16 weights, no cap)", cfg, args),
        "ours-stream": lambda: finetune_row("ours streamed", cfg, args, [
            "--stream", "--host-mem-gib", str(args.host_mem_gib), "--adam-bits", str(args.adam_bits),
            *(["--compile"] if args.compile else []), *args.stream_args.split()]),
        "fsdp2": lambda: hf_trained("FSDP2 CPU offload + ckpt", cfg, args, fsdp2_offload=True),
    }
    order = [(name, policy) for name in args.rows.split(",")
             for policy in (args.checkpoint.split(",") if name == "ours-capped" else [None])]
    print(f"device: {device_name()}, torch {torch.__version__}; cap {args.gpu_mem_gib} GiB for the capped rows")
    rows: list[Row] = []
    for name, policy in order:
        set_gpu_cap(args.gpu_mem_gib if name == "fsdp2" else None)  # our rows cap their own process
        reset_peak_rss()
        t0 = time.perf_counter()
        try:
            row = (finetune_row(f"ours capped, checkpoint {policy}", cfg, args, ["--recompute", policy]) if policy
                   else runs[name]())
        except Exception as e:  # one failing peer must not hide the others
            traceback.print_exc()
            print(f"  {name}: FAILED ({type(e).__name__}: {str(e)[:300]})", flush=True)
            continue
        if row is not None:
            row.extra.setdefault("peak_rss_gib", host_rss_gib()[1])  # this process's, unless the row ran in its own
            rows.append(row)
            print(f"  {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
        free_memory()  # an in-process row's model and optimizer (hooks hold reference cycles), before the next
    print(f"\n{args.model}, batch {args.batch} x {args.seq} (ratios against ours plain):")
    wait = "copy_wait_fraction"  # the share of a streamed step spent waiting for host<->device copies
    print_table(rows, baseline="ours plain (no cap)", columns={
        "peak RSS GiB": lambda r: f"{r.extra['peak_rss_gib']:.2f}",
        "copy wait": lambda r: f"{100 * r.extra[wait]:.1f}%" if wait in r.extra else "-"})
    write_json(args.out, rows, command="tasks.bench", model=args.model, cap_gib=args.gpu_mem_gib, batch=args.batch)


if __name__ == "__main__":
    main()
