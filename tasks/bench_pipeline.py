"""Pipeline throughput: nanotrain's schedules against torch.distributed.pipelining's, in one run.

    torchrun --nproc-per-node 4 -m tasks.bench_pipeline --model gpt2-xl --out bench_pipeline.json

Same model (random weights of the preset's shapes), same stage split, same micro-batches for
both engines. Per schedule: tokens/s over timed steps (after warm-up, devices synchronised),
peak memory per rank (``max_memory_allocated``: weights, gradients and activations), and the
bubble: measured for ours from CUDA events around every compute action (1 - busy / step time,
averaged over ranks), estimated for torch's engine from its step time and our measured compute
for the same schedule family, and the unit-cost theory of ``timeline.bubble_fraction``.
Steps are forward + backward (+ our tied-embedding all-reduce); no optimizer. ``--device cpu``
runs everything on gloo for a smoke test: ``torchrun --nproc-per-node 2 -m tasks.bench_pipeline
--device cpu --model tiny --n-layer 4 --seq 32 --steps 2``.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from nanotrain.config import GPT2Config
from nanotrain.model import final_norm, head_loss
from nanotrain.pipeline import (LayeredModel, StageSpec, bubble_fraction, build_pipeline, build_schedule,
                                close_pipeline, gpt2_layered, init_pipeline, partition, train_step)
from nanotrain.pipeline.schedule import Action
from nanotrain.tree import Tree, set_path

OURS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
         "zb-h1": "ScheduleInterleavedZeroBubble"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node 4 -m tasks.bench_pipeline",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-xl")
    p.add_argument("--n-layer", type=int, default=0, help="override the preset's depth (0: keep)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--virtual", type=int, default=2, help="stages per rank of the interleaved schedules")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--engines", default="ours,torch")
    p.add_argument("--schedules", default=",".join(OURS),
                   help="which schedules, comma-separated (e.g. leave out zb-h1 where torch's own zero-bubble "
                        "schedule fails, as its ScheduleInterleavedZeroBubble did on torch 2.11)")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--memory", action="store_true",
                   help="instead: peak memory of 1F1B at 16 and 1000 micro-batches and GPipe at 16 and 64")
    p.add_argument("--out", type=Path, default=Path("bench_pipeline.json"))
    return p.parse_args()


def random_params(model: LayeredModel, specs: list[StageSpec], stages: list[int], device: torch.device,
                  dtype: torch.dtype) -> Tree:
    """Random weights of the right shapes for ``stages``, made on the device (initialising gpt2-xl's
    1.5 B parameters through the reference init stream on every rank would take minutes)."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = model.skeleton()
    for path in sorted(set().union(*(specs[s].paths() for s in stages))):
        t = torch.randn(model.shapes[path], generator=gen, device=device, dtype=torch.float32) * 0.02
        set_path(params, path, t.to(dtype).requires_grad_())
    return params


class ComputeTimer:
    """Busy time of compute actions: CUDA events on the compute stream, or wall time on CPU."""

    def __init__(self, device: torch.device):
        self.cuda, self.spans, self.seconds = device.type == "cuda", [], 0.0

    @contextmanager
    def __call__(self, action: Action) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.append((start, end))
        else:
            t = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - t

    def busy_s(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in self.spans) / 1e3
        return self.seconds


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def measure(run_step, args, device: torch.device, timer: ComputeTimer | None = None) -> dict:
    """Warm up, then time ``args.steps`` steps; peak memory over the timed steps."""
    for _ in range(args.warmup):
        run_step(None)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        run_step(timer)
    sync(device)
    step_s = (time.perf_counter() - start) / args.steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    busy = timer.busy_s() / args.steps if timer else None
    return {"step_s": step_s, "peak_gib": peak, "busy_s": busy}


def bench_ours(ctx, model, name: str, args, params: dict[int, Tree], x, y) -> dict:
    schedule = build_schedule(name, ctx.world_size, args.microbatches, args.virtual)
    pipe = build_pipeline(ctx, model, schedule, x[0], dtype=args.torch_dtype, params=params[schedule.n_stages])

    def step(timer):
        train_step(pipe, None, x, y, timer=timer)

    result = measure(step, args, ctx.device, ComputeTimer(ctx.device))
    for p in pipe.parameters():
        p.grad = None
    return {"engine": "nanotrain", "schedule": name, "stages": schedule.n_stages,
            "theory": bubble_fraction(schedule), **result}


class TorchStage(nn.Module):
    """One of our stages as an nn.Module over the same weight storage, for torch's engine.

    The last stage ends with GPT-2's final LayerNorm; torch's schedule then applies ``head_loss``
    (the tied LM head and cross-entropy) as its ``loss_fn``. Torch's zero-bubble schedule frees
    stage outputs after the input-gradient pass, so a loss_fn must not need its input saved.
    """

    def __init__(self, spec: StageSpec, params: Tree, skeleton: Tree, cfg: GPT2Config):
        super().__init__()
        self.spec, self.cfg = dataclasses.replace(spec, head=None), cfg
        self.weights = nn.ParameterDict()
        self.tree = skeleton
        for path in sorted(spec.paths()):
            p = nn.Parameter(_get(params, path).detach())
            self.weights[path.replace(".", "__")] = p
            set_path(self.tree, path, p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.spec.forward(self.tree, x)
        return final_norm(self.tree, x, self.cfg) if self.spec.is_last else x


def _get(tree: Tree, path: str) -> torch.Tensor:
    for part in path.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree


def bench_torch(ctx, model, cfg: GPT2Config, name: str, args, params: dict[int, Tree], x, y, ours: dict | None) -> dict:
    from torch.distributed import pipelining  # lazily: only this comparison needs it

    p = ctx.world_size
    # ZB-H1 is the one-stage-per-rank case of torch's interleaved zero-bubble schedule.
    n_stages = p * (args.virtual if name == "interleaved-1f1b" else 1)
    specs = partition(model, n_stages)
    mine = list(range(ctx.rank, n_stages, p))
    modules = [TorchStage(specs[s], params[n_stages], model.skeleton(), cfg) for s in mine]
    stages = [pipelining.PipelineStage(m, s, n_stages, ctx.device) for m, s in zip(modules, mine, strict=True)]
    last = modules[-1] if mine[-1] == n_stages - 1 else None
    denom = float(y.numel())

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return head_loss(last.tree, out, target, denom)

    cls = getattr(pipelining, TORCH[name])
    multi = name in ("interleaved-1f1b", "zb-h1")
    sched = cls(stages if multi else stages[0], args.microbatches, loss_fn=loss_fn, scale_grads=False)
    inputs = x.flatten(0, 1).to(ctx.device)
    targets = y.flatten(0, 1).to(ctx.device)

    def step(timer):
        kwargs = {"target": targets} if last is not None else {}
        sched.step(*((inputs,) if 0 in mine else ()), **kwargs)

    result = measure(step, args, ctx.device)
    if ours and ours.get("busy_s") is not None:
        result["bubble_est"] = 1 - ours["busy_s"] / result["step_s"]
    return {"engine": "torch.pipelining", "schedule": TORCH[name], "stages": n_stages,
            "theory": ours["theory"] if ours else None, **result}


def main() -> None:
    args = parse_args()
    ctx = init_pipeline("gloo" if args.device == "cpu" else None, timeout_s=600)
    dtype = args.torch_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = GPT2Config.from_name(args.model, **({"n_layer": args.n_layer} if args.n_layer else {}))
    model = gpt2_layered(cfg, args.seq)
    gen = torch.Generator().manual_seed(0)
    shape = (args.microbatches, args.micro_batch_size, args.seq)
    x = torch.randint(0, cfg.vocab_size, shape, generator=gen)
    y = torch.randint(0, cfg.vocab_size, shape, generator=gen)
    p = ctx.world_size
    params = {}
    for n_stages in (p,) if args.memory else (p, p * args.virtual):
        specs = partition(model, n_stages)
        params[n_stages] = random_params(model, specs, list(range(ctx.rank, n_stages, p)), ctx.device, dtype)
    if args.memory:
        memory_check(ctx, model, args, params[p], cfg)
        close_pipeline(ctx)
        return
    engines = args.engines.split(",")
    schedules = args.schedules.split(",")
    if unknown := sorted(set(schedules) - set(OURS)):
        raise SystemExit(f"unknown schedule(s) {', '.join(unknown)} (known: {', '.join(OURS)})")
    rows: list[dict] = []
    with ctx.guard():
        for name in schedules:
            ctx.where = f"the benchmark of nanotrain's {name}"
            if "ours" in engines:
                rows.append(bench_ours(ctx, model, name, args, params, x, y))
                save(ctx, args, cfg, rows)
        for name in schedules:
            # A schedule torch's engine cannot run stops every rank (with its error); results so far are saved.
            ctx.where = f"the benchmark of torch's {TORCH[name]}"
            if "torch" in engines:
                ours = next((r for r in rows if r["schedule"] == name), None)
                rows.append(bench_torch(ctx, model, cfg, name, args, params, x, y, ours))
                save(ctx, args, cfg, rows)
            gc.collect()
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
    if ctx.rank == 0:
        print_table(args, cfg, json.loads(args.out.read_text())["results"])
    close_pipeline(ctx)


def save(ctx, args: argparse.Namespace, cfg: GPT2Config, rows: list[dict]) -> None:
    """Gather every rank's rows and (rank 0) rewrite the JSON, so a later failure loses nothing."""
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, rows)
    if ctx.rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        config = {k: str(v) for k, v in vars(args).items() if k != "torch_dtype"}
        args.out.write_text(json.dumps({"config": config, "results": combine(args, gathered)}, indent=1))


def memory_check(ctx, model: LayeredModel, args: argparse.Namespace, params: Tree, cfg: GPT2Config) -> None:
    """Peak memory of one step above the weights: flat in the micro-batch count for 1F1B, linear for GPipe."""
    rows = []
    with ctx.guard():
        for name, micro in (("1f1b", 16), ("1f1b", 1000), ("gpipe", 16), ("gpipe", 64)):
            ctx.where = f"the memory check of {name} with {micro} micro-batches"
            shape = (micro, args.micro_batch_size, args.seq)
            x = torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(0))
            pipe = build_pipeline(ctx, model, build_schedule(name, ctx.world_size, micro), x[0],
                                  dtype=args.torch_dtype, params=params)
            sync(ctx.device)
            base = torch.cuda.memory_allocated() if ctx.device.type == "cuda" else 0
            if ctx.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            train_step(pipe, None, x, x)
            sync(ctx.device)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if ctx.device.type == "cuda" else float("nan")
            rows.append({"schedule": name, "microbatches": micro, "peak_above_weights_gib": peak,
                         "step_s": time.perf_counter() - start})
            for t in pipe.parameters():
                t.grad = None
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, rows)
    if ctx.rank == 0:
        print(f"\n{args.model}, micro-batches of {args.micro_batch_size} x {args.seq}: peak GiB above the weights")
        for i, row in enumerate(gathered[0]):
            peaks = "/".join(f"{g[i]['peak_above_weights_gib']:.2f}" for g in gathered)
            print(f"{row['schedule']:>6s} {row['microbatches']:5d} micro-batches: {peaks} per rank "
                  f"({row['step_s']:.1f} s)")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"memory": [[r[i] for r in gathered] for i in range(len(rows))]}, indent=1))
        print(f"wrote {args.out}")


def combine(args: argparse.Namespace, per_rank: list[list[dict]]) -> list[dict]:
    """One row per benchmark: the slowest rank's step time, every rank's peak memory, mean bubble."""
    tokens = args.microbatches * args.micro_batch_size * args.seq
    table = []
    for i, row in enumerate(per_rank[0]):
        ranks = [r[i] for r in per_rank]
        step_s = max(r["step_s"] for r in ranks)
        busy = [r["busy_s"] for r in ranks if r.get("busy_s") is not None]
        table.append({
            "engine": row["engine"], "schedule": row["schedule"], "stages": row["stages"],
            "tokens_per_s": tokens / step_s, "step_ms": 1e3 * step_s,
            "peak_gib_per_rank": [r["peak_gib"] for r in ranks],
            "bubble_measured": (1 - sum(busy) / len(busy) / step_s) if busy else None,
            "bubble_estimated": (sum(r["bubble_est"] for r in ranks) / len(ranks)) if "bubble_est" in row else None,
            "bubble_theory": row["theory"],
        })
    return table


def print_table(args: argparse.Namespace, cfg: GPT2Config, table: list[dict]) -> None:
    print(f"\n{args.model} ({cfg.n_layer} layers), {args.microbatches} micro-batches of "
          f"{args.micro_batch_size} x {args.seq} tokens, {args.dtype}")
    print(f"{'engine':>17s} {'schedule':>30s} {'stages':>6s} {'tokens/s':>10s} {'step ms':>8s} "
          f"{'peak GiB per rank':>24s} {'bubble':>7s} {'theory':>7s}")
    for r in table:
        bubble = r["bubble_measured"] if r["bubble_measured"] is not None else r["bubble_estimated"]
        shown = "-" if bubble is None else ("" if r["bubble_measured"] is not None else "~") + f"{bubble:.1%}"
        theory = "-" if r["bubble_theory"] is None else f"{r['bubble_theory']:.1%}"
        peaks = "/".join(f"{g:.1f}" for g in r["peak_gib_per_rank"])
        print(f"{r['engine']:>17s} {r['schedule']:>30s} {r['stages']:6d} {r['tokens_per_s']:10.0f} "
              f"{r['step_ms']:8.1f} {peaks:>24s} {shown:>7s} {theory:>7s}")
    print("bubble: measured from CUDA events for nanotrain; ~ estimated for torch from its step time and our "
          "compute time for the same schedule; theory: unit-cost timeline, F=1, B=2, I=W=1")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
