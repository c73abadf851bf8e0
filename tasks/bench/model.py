"""Plain forward+backward speed of our model against HF transformers' of the same family, in one run on one GPU.

    python -m tasks.bench.model --models gpt2-large,gpt2-xl --micro-batches 8,16,32 --out runs/bench_model.json

bf16 weights and compute, sequence 1024, random weights of the real shapes, dropout off for both,
no optimizer step, no memory limit; each implementation at its best micro-batch of those given.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanotrain.core.models import model_spec, preset, run
from nanotrain.core.models.ops import PLAIN
from nanotrain.core.tree import named_leaves
from tasks.bench.common import (Row, device_name, need_cuda, peak_gib, print_table, profile_table, reset_peak,
                                time_steps, write_json)
from tasks.bench.peers.hf import hf_step

SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION}  # scaled_dot_product_attention's backends, by name


def ours_step(cfg: Any, mb: int, seq: int, compiled: bool, chunk_tokens: int = 2048,
              compile_kw: dict | None = None, whole: bool = False):
    """One forward+backward of our model, blocks compiled (with ``compile_kw``) when ``compiled``; with
    ``whole`` instead one compiled graph for embeddings, blocks and final norm (``tasks.bench.plain_variants``)."""
    spec = model_spec(cfg)
    params = run.init_params(spec, seed=0, dtype=torch.bfloat16, device="cuda")
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    tokens = torch.randint(0, spec.vocab_size, (mb, seq), device="cuda")
    targets = torch.randint(0, spec.vocab_size, (mb, seq), device="cuda")
    if whole:
        body = torch.compile(lambda params, tokens: run.run_units(spec, params, tokens), dynamic=False,
                             **(compile_kw or {}))

        def loss() -> torch.Tensor:
            return PLAIN.head_loss(body(params, tokens), params[spec.head_weight], targets, mb * seq, chunk_tokens)
    else:
        # Static shapes: a second model would otherwise trigger a dynamic-shape recompile (slower kernels).
        # Compiled unbound: a compiled functools.partial shares one wrapper frame (and its recompile limit) with
        # every other compiled partial, and falls back to eager after 8 shapes.
        block = torch.compile(run.block, dynamic=False, **(compile_kw or {})) if compiled else run.block

        def loss() -> torch.Tensor:
            return run.run_units(spec, params, tokens, targets, denom=mb * seq, chunk_tokens=chunk_tokens,
                                 block_fn=lambda p, x, seed, index, ops: block(spec, p, x, ops))

    def step() -> None:
        loss().backward()
        for t in leaves:
            t.grad = None
    return step


def best_of(name: str, make, cfg: Any, micro_batches: list[int], seq: int, warmup: int, steps: int,
            do_profile: bool = False) -> Row | None:
    """The step of each micro-batch (``make(mb)`` builds it) timed after ``warmup`` calls, unless out of memory;
    the fastest row, named ``name``."""
    rows = []
    for mb in micro_batches:
        label = f"{name} mb={mb}"
        reset_peak()
        try:
            step = make(mb)
            if do_profile:
                profile_table(label, step, warmup)
            dt = time_steps(step, warmup, steps)
        except torch.OutOfMemoryError:
            print(f"  {label}: out of memory", flush=True)
            continue
        rows.append(Row.measured(label, cfg, mb, seq, dt, peak_gib(), micro_batch=mb))
        print(f"  {label}: {rows[-1].seq_per_s:.2f} seq/s, peak {rows[-1].peak_gib:.1f} GiB", flush=True)
    if not rows:
        return None
    top = max(rows, key=lambda r: r.seq_per_s)
    top.name = name
    return top


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2-large,gpt2-xl")
    ap.add_argument("--micro-batches", default="8,16,32")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--impls", default="hf,ours,ours-compiled")
    ap.add_argument("--out", default=None, help="write all measurements as JSON here")
    ap.add_argument("--profile", action="store_true", help="print a kernel-time table for each configuration")
    ap.add_argument("--attention", default="auto", choices=["auto", *SDPA],
                    help="restrict scaled_dot_product_attention to one backend (ours and HF alike)")
    args = ap.parse_args()
    need_cuda("tasks.bench.model")
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.attention != "auto":
        sdpa_kernel(SDPA[args.attention]).__enter__()  # for the whole process
    print(f"device: {device_name()}, torch {torch.__version__}")
    best: list[Row] = []
    for model in args.models.split(","):
        cfg = preset(model)
        torch._dynamo.reset()
        for impl in args.impls.split(","):
            make = {"hf": lambda mb: hf_step(cfg, mb, args.seq),
                    "ours": lambda mb: ours_step(cfg, mb, args.seq, compiled=False),
                    "ours-compiled": lambda mb: ours_step(cfg, mb, args.seq, compiled=True)}[impl]
            top = best_of(f"{model} {impl}", make, cfg, [int(m) for m in args.micro_batches.split(",")], args.seq,
                          args.warmup, args.steps, args.profile)
            if top:
                best.append(top)
        print(f"\n{model}, best micro-batch each (ratio against HF):")
        print_table([r for r in best if r.name.startswith(model + " ")], baseline=f"{model} hf")
    write_json(args.out, best, command="tasks.bench.model", seq=args.seq)


if __name__ == "__main__":
    main()
