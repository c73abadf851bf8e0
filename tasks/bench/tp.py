"""Tensor-parallel GPT-2 training steps: nanotrain's engine against PyTorch DTensor, in one run.

    torchrun --nproc_per_node 4 -m tasks.bench.tp --out runs/bench_tp.json
    torchrun --nproc_per_node 2 -m tasks.bench.tp --tp 1,2 --out runs/bench_tp_2gpu.json
    torchrun --nproc_per_node 2 -m tasks.bench.tp --tp 1,2 --tp-overlap off,on --engines nanotrain
    torchrun --nproc_per_node 2 -m tasks.bench.tp --tp 1,2 --heads 25 --engines nanotrain
    torchrun --nproc_per_node 2 -m tasks.bench.tp --tp 1,2 --compile off,on --engines nanotrain

For each TP size (ranks 0..tp-1 work, the others wait), with and without sequence parallelism:

* ``nanotrain``: the parameter tree sharded by ``shard_params``, ``parallel_loss`` (vocab-parallel
  cross-entropy), ``sync_grads``. With ``--tp-overlap on`` its collectives travel while matmuls
  compute (``tensor_parallel.overlap``): ring steps with sequence parallelism, chunked and
  asynchronous all-reduces without. With ``--compile on`` each block's local compute runs as
  ``torch.compile``d regions (inductor) with the collectives between them (``tensor_parallel.ops``).
* ``dtensor`` (``tasks/bench/peers/dtensor.py``, its plan there): the same model as an ``nn.Module``
  parallelized by ``parallelize_module`` with torchtitan's plan; SDPA attention, AdamW (foreach) on
  the local shards. At TP=1 it is the plain module. With ``--peer-compile on`` (the default with
  CUDA) each of its blocks is ``torch.compile``d after parallelization, as torchtitan compiles per
  block: the peer at its best.

Both start from the same weights, take a full step (forward, backward, AdamW) under bf16 autocast
with fp32 weights, dropout off. Each configuration runs ``--warmup`` steps, then ``--windows``
windows of ``--steps`` steps, each timed with the device synchronized at both ends. Reported:
tokens/s of the median window with the slowest and fastest beside it, MFU over the TP group, peak
memory (the largest of the group), scaling efficiency (median tokens/s over tp times the same
engine's TP=1), and the first step's loss as a check that both compute the same model.

gpt2-xl has 25 heads, which 2 and 4 ranks cannot share evenly. nanotrain splits heads unevenly
(13/12, 7/6/6/6), but DTensor's colwise q/k/v would cut a head in half, so by default both run
``--heads 20`` (head size 80): every weight has gpt2-xl's shape and the FLOPs are the same.
``--heads 25`` runs the real head count (head size 64), for nanotrain alone at TP>1: beside a
``--heads 20`` run it shows what the uneven split costs (the rank with 13 heads sets the pace).
"""
from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist

from nanotrain.core import models
from nanotrain.distributed import GridConfig, RankGrid, build_grid, close_distributed, init_distributed
from nanotrain.core.models import model_spec, preset
from nanotrain.tensor_parallel import parallel_loss, plan_tp, shard_params, sync_grads
from nanotrain.core.tree import Tree, named_leaves, tree_map
from tasks.bench.common import (Row, device_name, free_memory, need_cuda, peak_gib, print_table, profile_table,
                                reset_peak, time_windows, write_json)
from tasks.bench.peers.dtensor import autocast, dtensor_step
from weights import load_weights

ENGINES = ("nanotrain", "dtensor")


def nanotrain_step(full: Tree, cfg: Any, grid: RankGrid, sp: bool, tokens, targets, device, lr: float,
                   overlap: bool = False, compiled: bool = False):
    """One training step of our engine on this rank's shards of ``full`` (the peer's: ``dtensor_step``)."""
    plan = plan_tp(cfg, grid, sequence_parallel=sp, overlap=overlap, compile="inductor" if compiled else None)
    local = tree_map(lambda t: t.to(device).requires_grad_(), shard_params(full, plan))
    opt = torch.optim.AdamW([t for _, t in named_leaves(local)], lr=lr, foreach=True)

    def step() -> torch.Tensor:
        with autocast(device):
            loss = parallel_loss(local, tokens, targets, plan)
        loss.backward()
        sync_grads(local, plan)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    step.params = local  # what it trains: tests/tensor_parallel/test_tp_bench records the gradients applied
    return step


def measure(engine: str, full: Tree, cfg: Any, grid: RankGrid, sp: bool, args, device,
            overlap: bool = False, compiled: bool = False) -> Row:
    """One configuration on the ranks of ``grid``: first step's loss, then timed steps and peak memory."""
    g = torch.Generator().manual_seed(1)
    vocab = model_spec(cfg).vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
    targets = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
    if engine == "nanotrain":
        step = nanotrain_step(full, cfg, grid, sp, tokens, targets, device, args.lr, overlap, compiled)
    else:
        step = dtensor_step(full, cfg, grid, sp, tokens, targets, device, args.lr, args.peer_vocab == "padded",
                            args.peer_optimizer == "local", compiled)
    # Peak memory of training alone: the DTensor peer is built whole on the GPU, then sharded.
    reset_peak()
    first_loss = float(step())
    if args.profile:  # every rank steps (they talk), rank 0 prints
        profile_table(f"{engine} tp={grid.tp} sp={sp} overlap={overlap} compiled={compiled}", step,
                      show=dist.get_rank() == 0)
    windows = time_windows(step, args.warmup, args.steps, args.windows)
    dt = statistics.median(windows)
    peak = torch.tensor([peak_gib()], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=grid.tp_group)
    name = (f"{engine} tp={grid.tp}{' sp' if sp else ''}{' overlap' if overlap else ''}"
            f"{' compiled' if compiled else ''}")
    return Row.measured(name, cfg, args.batch, args.seq, dt, float(peak), mfu_over=grid.tp, engine=engine,
                        tp=grid.tp, sp=sp, overlap=overlap, compiled=compiled, first_loss=first_loss, step_s=dt,
                        window_tok_s=[args.batch * args.seq / w for w in windows])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-xl")
    ap.add_argument("--heads", "--n-head", dest="n_head", type=int, default=20,
                    help="attention heads, head size n_embd / heads (gpt2-xl has 25; see above)")
    ap.add_argument("--tp", default="1,2,4", help="TP sizes, each at most the number of ranks")
    ap.add_argument("--engines", default="nanotrain,dtensor")
    ap.add_argument("--sp", default="off,on", help="sequence parallelism: off, on or off,on")
    ap.add_argument("--tp-overlap", default="off", help="nanotrain at TP>1 with its collectives overlapped with the "
                    "matmuls (see above): off, on or off,on")
    ap.add_argument("--compile", default="off", help="nanotrain with each block's local compute torch.compile'd "
                    "(see above): off, on or off,on")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--peer-vocab", choices=["padded", "exact"], default="padded",
                    help="DTensor peer's vocabulary: padded like ours to a multiple of 64 per rank (fast GEMMs, "
                         "padding logits in its softmax) or exactly 50257 (slow cuBLAS kernels)")
    ap.add_argument("--peer-optimizer", choices=["local", "dtensor"], default="local",
                    help="DTensor peer's AdamW: on each rank's local shards (as ours) or on the DTensors themselves "
                         "(every foreach op through DTensor's dispatch, a CPU cost per parameter)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed window")
    ap.add_argument("--windows", type=int, default=5, help="timed windows per configuration: the median is "
                    "reported, with the fastest and slowest window")
    ap.add_argument("--peer-compile", choices=["off", "on"], default=None,
                    help="the DTensor peer with each block torch.compile'd after parallelization, as torchtitan "
                         "does (default: on with CUDA, off on the CPU)")
    ap.add_argument("--weights", default="random", help="'random' (seeded, made leaf by leaf as loaded), 'init' "
                    "(init_params in memory, no file) or a model.safetensors path")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo, a smoke test only")
    ap.add_argument("--profile", action="store_true", help="print a kernel-time table per configuration (rank 0)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)

    if not all(set(a.split(",")) <= {"off", "on"} for a in (args.sp, args.tp_overlap, args.compile)):
        raise SystemExit(f"error: --sp {args.sp!r}, --tp-overlap {args.tp_overlap!r} and --compile {args.compile!r} "
                         f"take off, on or off,on")
    overlaps = [o == "on" for o in args.tp_overlap.split(",")]
    peer_compiled = (args.peer_compile or ("on" if args.device == "cuda" else "off")) == "on"
    compiles = [c == "on" for c in args.compile.split(",")]
    if args.device == "cuda":
        need_cuda("tasks.bench.tp", "--device cpu")
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun, e.g. torchrun --nproc_per_node 4 -m tasks.bench.tp")
    ctx = init_distributed(backend="nccl" if args.device == "cuda" else "gloo", timeout_s=600)
    device, world, rank = ctx.device, ctx.world_size, ctx.rank
    tps = [int(t) for t in args.tp.split(",")]
    engines = args.engines.split(",")
    if unknown := [e for e in engines if e not in ENGINES]:
        raise SystemExit(f"unknown engine {unknown[0]!r} (known: {', '.join(ENGINES)})")
    if max(tps) > world:
        raise SystemExit(f"--tp {args.tp} asks for {max(tps)} ranks but torchrun started {world}; "
                         f"use --nproc_per_node {max(tps)} or smaller TP sizes")
    try:
        cfg = preset(args.model, n_head=args.n_head)
    except ValueError as e:
        raise SystemExit(f"error: --heads {args.n_head}: {e}; e.g. 20 or 25 for gpt2-xl")
    full, heads = load_full(args, cfg), model_spec(cfg).heads[0]
    # collective: every rank builds every grid
    grids = {tp: build_grid(GridConfig(tp=tp), ranks=range(tp), timeout=ctx.grid.timeout) for tp in tps}
    rows: list[Row] = []
    for tp in tps:
        for sp in ([False] if tp == 1 else [s == "on" for s in args.sp.split(",")]):
            for engine in engines:
                if engine == "dtensor" and heads % tp:
                    if rank == 0:
                        print(f"skip dtensor tp={tp}: {heads} heads do not split over {tp} ranks", flush=True)
                    continue
                variants = [(o, c) for o in (overlaps if engine == "nanotrain" and tp > 1 else [False])
                            for c in (compiles if engine == "nanotrain" else [peer_compiled])]
                for overlap, compiled in variants:
                    if grids[tp] is not None:
                        free_memory()
                        row = measure(engine, full, cfg, grids[tp], sp, args, device, overlap, compiled)
                        if rank == 0:
                            rows.append(row)
                            print(f"  {row.name}: {row.tokens_per_s:.0f} tok/s, peak {row.peak_gib:.1f} GiB",
                                  flush=True)
                    dist.barrier()
    if rank == 0:
        print(f"\n{args.model} ({heads} heads), batch {args.batch} x {args.seq}, {device_name()}, "
              f"{world} ranks; efficiency = tok/s / (tp x tok/s at tp=1 of the same engine, compiled or not)")
        base = {(r.extra["engine"], r.extra["compiled"]): r.tokens_per_s for r in rows if r.extra["tp"] == 1}
        for r in rows:
            one = base.get((r.extra["engine"], r.extra["compiled"]))
            r.extra["efficiency"] = r.tokens_per_s / (r.extra["tp"] * one) if one else float("nan")
        print_table(rows, columns={
            "tok/s min-max": lambda r: f"{min(r.extra['window_tok_s']):.0f}-{max(r.extra['window_tok_s']):.0f}",
            "tok/s/GPU": lambda r: f"{r.tokens_per_s / r.extra['tp']:.0f}",
            "efficiency": lambda r: f"{100 * r.extra['efficiency']:.1f}%",
            "loss@0": lambda r: f"{r.extra['first_loss']:.4f}"})
        write_json(args.out, rows, command="tasks.bench.tp", model=args.model, n_head=heads, batch=args.batch,
                   seq=args.seq, world=world, tp_overlap=args.tp_overlap,
                   compile=args.compile, peer_compile=peer_compiled, windows=args.windows, steps=args.steps)
    close_distributed(ctx)


def load_full(args, cfg: Any) -> Tree:
    """The full fp32 tree on the CPU, the same on every rank; rank 0 loads first (a hub download happens once)."""
    if args.weights == "init":
        return models.init_params(cfg, seed=0)
    if dist.get_rank() == 0:
        full = load_weights(cfg, args.weights)  # a hub model is fetched once, before anyone reads it
    dist.barrier()
    return full if dist.get_rank() == 0 else load_weights(cfg, args.weights)


if __name__ == "__main__":
    main()
