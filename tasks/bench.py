"""The fine-tuning job under a GPU memory cap beside its peers, in one run on one GPU.

    python -m tasks.bench --model gpt2-large --gpu-mem-gib 11 --out runs/bench.json

Rows (batch 64 x 1024 per optimizer step unless given otherwise, random weights of real shapes):
- ``ours plain``: our forward+backward at its best micro-batch, no cap, no optimizer (the ceiling);
- ``HF plain``: transformers' forward+backward, same conditions;
- ``ours capped``: ``tasks.finetune``'s trainer, every parameter updated by AdamW each step,
  under the cap (``torch.cuda.set_per_process_memory_fraction``: an overshoot is an error);
- ``FSDP2 offload``: transformers' model under torch FSDP2 with ``CPUOffloadPolicy``, bf16
  mixed precision, gradient checkpointing, AdamW on the CPU, micro-batch 8 x 8, same cap.
Each row reports seq/s, tokens/s, MFU, peak GPU GiB and the process's peak RSS during the row.
A row that fails prints its error and the others still run.
"""
from __future__ import annotations

import argparse
import gc
import os
import time
import traceback

import torch

from nanotrain.benchmark import Row, device_name, peak_gib, print_table, reset_peak, time_steps, write_json
from nanotrain.config import GPT2Config
from nanotrain.flops import mfu, peak_flops
from nanotrain.memory import host_rss_gib, set_gpu_cap
from tasks.bench_model import best_of, hf_model, hf_step, ours_step


def reset_peak_rss() -> None:
    """Reset the kernel's high-water mark of this process's RSS (Linux: clear_refs 5)."""
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _row(name: str, cfg: GPT2Config, seq: int, seqs: int, seconds: float, **extra) -> Row:
    tok_s = seqs * seq / seconds
    extra["peak_rss_gib"] = host_rss_gib()[1]
    return Row(name, seqs / seconds, tok_s, mfu(tok_s, cfg, seq, peak_flops(device_name())), peak_gib(), extra)


def plain(name: str, make, cfg: GPT2Config, seq: int, micro_batches: list[int], args) -> Row | None:
    row = best_of(name, lambda mb: make(cfg, mb), cfg, micro_batches, seq, args.warmup, args.steps)
    if row is not None:
        row.extra["peak_rss_gib"] = host_rss_gib()[1]
    return row


def ours_capped(cfg: GPT2Config, args, checkpoint: str) -> Row:
    import json

    from tasks.finetune import main as finetune

    out = f"/tmp/nanotrain-bench-{os.getpid()}-{checkpoint}"
    argv = ["--model", args.model, "--gpu-mem-gib", str(args.gpu_mem_gib), "--batch", str(args.batch), "--seq",
            str(args.seq), "--steps", str(args.warmup + args.steps), "--weights", "random", "--data", args.data,
            "--checkpoint", checkpoint, "--out", out, "--fixed-batch"]
    if args.tokenizer_dir:
        argv += ["--tokenizer-dir", args.tokenizer_dir]
    if args.micro_batch:
        argv += ["--micro-batch", str(args.micro_batch)]
    reset_peak()
    finetune(argv)
    rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")][args.warmup:]
    seconds = sum(r["step_s"] for r in rows) / len(rows)
    return _row(f"ours capped, checkpoint {checkpoint}", cfg, args.seq, args.batch, seconds,
                losses=[r["loss"] for r in rows])


def fsdp2_offload(cfg: GPT2Config, args) -> Row:
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29512", rank=0, world_size=1)
    model = hf_model(cfg)
    model.gradient_checkpointing_enable()
    policy = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                  offload_policy=CPUOffloadPolicy())
    for block in model.transformer.h:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mb = 8
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))

    def step() -> None:
        for chunk in tokens.split(mb):
            chunk = chunk.cuda(non_blocking=True)
            (model(input_ids=chunk, labels=chunk).loss / (args.batch // mb)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    reset_peak()
    dt = time_steps(step, args.warmup, args.steps)
    return _row("FSDP2 CPU offload + ckpt", cfg, args.seq, args.batch, dt, micro_batch=mb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-large")
    ap.add_argument("--gpu-mem-gib", type=float, default=11.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--checkpoint", default="selective", help="policies of the capped rows, comma-separated")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--data", default="stdlib")
    ap.add_argument("--tokenizer-dir", default=None)
    ap.add_argument("--plain-micro-batches", default="8,16")
    ap.add_argument("--rows", default="ours-plain,hf-plain,ours-capped,fsdp2", help="which rows, in this order")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tasks.bench measures GPU throughput: it needs a CUDA GPU")
    cfg = GPT2Config.from_name(args.model)
    mbs = [int(m) for m in args.plain_micro_batches.split(",")]
    runs = {
        "ours-plain": lambda: plain("ours plain (no cap)", lambda c, m: ours_step(c, m, args.seq, False), cfg,
                                    args.seq, mbs, args),
        "hf-plain": lambda: plain("HF plain (no cap)", lambda c, m: hf_step(c, m, args.seq), cfg, args.seq, mbs, args),
        "fsdp2": lambda: fsdp2_offload(cfg, args),
    }
    order = []
    for name in args.rows.split(","):
        for policy in args.checkpoint.split(",") if name == "ours-capped" else [None]:
            order.append((name, policy))
    print(f"device: {device_name()}, torch {torch.__version__}; cap {args.gpu_mem_gib} GiB for the capped rows")
    rows: list[Row] = []
    for name, policy in order:
        set_gpu_cap(args.gpu_mem_gib if name in ("ours-capped", "fsdp2") else None)
        reset_peak_rss()
        t0 = time.perf_counter()
        try:
            row = ours_capped(cfg, args, policy) if policy else runs[name]()
        except Exception as e:  # one failing peer must not hide the others
            traceback.print_exc()
            print(f"  {name}: FAILED ({type(e).__name__}: {str(e)[:300]})", flush=True)
            continue
        if row is not None:
            rows.append(row)
            print(f"  {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
        gc.collect()  # the trainer's hooks hold reference cycles: free its GPU memory before the next row
        torch.cuda.empty_cache()
    print(f"\n{args.model}, batch {args.batch} x {args.seq} (ratios against ours plain):")
    print_table(rows, baseline="ours plain (no cap)")
    for r in rows:
        print(f"  {r.name}: peak RSS {r.extra['peak_rss_gib']:.2f} GiB")
    write_json(args.out, rows, command="tasks.bench", model=args.model, cap_gib=args.gpu_mem_gib, batch=args.batch)


if __name__ == "__main__":
    main()
