"""Pipeline throughput: nanotrain's schedules against torch.distributed.pipelining's, in one run.

    torchrun --nproc-per-node 4 -m tasks.bench.pipeline --model gpt2-xl --out bench_pipeline.json

Same model (random weights of the preset's shapes), same stage split, same micro-batches for
both engines, the batch on the device before the step. Per schedule: tokens/s over timed steps
(after warm-up, devices synchronised, no instruments), peak memory per rank
(``max_memory_allocated``: weights, gradients and activations), and the bubble: measured for ours
in a second timed run with CUDA events around every compute action (1 - busy / step time,
averaged over ranks), estimated for torch's engine from its step time and our measured compute
for the same schedule family, and the unit-cost theory of ``timeline.bubble_fraction``.
The split balances layer costs timed one by one, then corrected by each stage's time in short
runs of the pipeline (``--rebalance``): an uneven split adds its own bubble.
Steps are forward + backward + the tied-embedding all-reduce (both engines); no optimizer.
``--repeats 3`` times every schedule of both engines three times in turn and prints each ratio
and their median: engines at parity differ by less than one machine's drift over a run.
Micro-batches of 1 x 1024 leave gpt2-xl's stages launch-bound (the host CPU's speed shows in
the figures); ``--micro-batch-size 4`` measures the GPUs. ``--device cpu`` runs everything on
gloo for a smoke test: ``torchrun --nproc-per-node 2 -m tasks.bench.pipeline --device cpu
--model tiny --n-layer 4 --seq 32 --steps 2``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from nanotrain.distributed import (GridConfig, close_distributed, init_distributed, launched_world_size)
from nanotrain.core.models import ModelSpec, model_spec, preset
from tasks.bench.pipeline_clock import ActionClock, mean_ms_by_kind
from tasks.bench.pipeline_costs import balance_by_measurement, random_tree
from nanotrain.pipeline.layered import describe
from tasks.bench.pipeline_rebalance import imbalance, rebalance
from tasks.bench.pipeline_report import gathered, plot_timelines, print_table, save
from nanotrain.pipeline import LayeredModel, bubble_fraction, build_pipeline, build_schedule, partition, train_step
from nanotrain.core.tree import Tree
from tasks.bench.common import free_memory, need_cuda, peak_gib, reset_peak, save_json, sync, time_steps
from tasks.bench.peers.pipeline import TORCH, torch_pipeline_step

OURS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node 4 -m tasks.bench.pipeline",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-xl")
    p.add_argument("--n-layer", type=int, default=0, help="override the preset's depth (0: keep)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=1)
    # Not --virtual: torchrun would take that for an abbreviation of its own --virtual-local-rank.
    p.add_argument("--virtual-stages", type=int, default=2, help="stages per rank of the interleaved schedules")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1,
                   help="time every schedule of both engines this many times, in turn, for the spread of the ratio")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--layers", choices=("blocks", "sublayers"), default="sublayers",
                   help="pipeline layers: each block's attention and MLP apart (finer stage balance: interleaved "
                        "1F1B's 8 stages ran 5%% faster than with whole blocks, the others alike) or whole blocks")
    p.add_argument("--balance", choices=("measured", "flops"), default="measured",
                   help="split stages by each layer's forward+backward time measured here (averaged over ranks) "
                        "or by the model's FLOP counts")
    p.add_argument("--rebalance", type=int, default=None,
                   help="rounds of refining the costs from each stage's compute time in short runs of the pipeline "
                        "(1F1B; interleaved 1F1B for its split), then splitting again (default: 3 when balanced by "
                        "measurement, else 0)")
    p.add_argument("--engines", default="ours,torch")
    p.add_argument("--schedules", default=",".join(OURS),
                   help="which schedules, comma-separated (e.g. leave out zb-h1 where torch's own zero-bubble "
                        "schedule fails, as its ScheduleInterleavedZeroBubble did on torch 2.11)")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--memory", action="store_true",
                   help="instead: peak memory of 1F1B at 16 and 1000 micro-batches and GPipe at 16 and 64")
    p.add_argument("--out", type=Path, default=Path("bench_pipeline.json"))
    return p.parse_args()


def random_params(ctx, model: LayeredModel, n_stages: int, dtype: torch.dtype) -> Tree:
    """Random weights of the right shapes for this rank's stages of ``model`` cut ``n_stages`` ways, made on the
    device (initialising gpt2-xl's 1.5 B parameters through the reference init stream on every rank would take
    minutes)."""
    specs = partition(model, n_stages)
    paths = sorted(set().union(*(specs[s].paths() for s in range(ctx.rank, n_stages, ctx.world_size))))
    return random_tree(model, paths, ctx.device, dtype, torch.Generator(device=ctx.device).manual_seed(0))


def sync_ranks() -> None:
    """The device, then every rank: a step starts and ends together on every stage."""
    sync()
    dist.barrier()


def measure(run_step, args, device: torch.device, clock: ActionClock | None = None) -> dict:
    """Warm up, then time ``args.steps`` steps; peak memory over the timed steps.

    With a ``clock``: this rank's compute seconds per step, the mean duration of each of its
    (stage, kind) actions over the timed steps, and the last step's spans (ms from its start).
    """
    for _ in range(args.warmup):
        run_step(None)
    reset_peak(device, empty_cache=False)

    def step() -> None:
        if clock:
            clock.start_step()
        run_step(clock)

    step_s = time_steps(step, 0, args.steps, sync_ranks)
    peak = peak_gib(device)
    if clock is None:
        return {"step_s": step_s, "peak_gib": peak, "busy_s": None}
    return {"step_s": step_s, "peak_gib": peak, "busy_s": clock.busy_per_step_s(),
            "mean_ms": [[stage, kind, ms] for (stage, kind), ms in
                        mean_ms_by_kind([span for i in range(args.steps) for span in clock.spans(i)]).items()],
            "spans": [[a.kind, a.mb, a.stage, start, end] for a, start, end in clock.spans()]}


def bench_ours(ctx, models: dict[int, LayeredModel], name: str, args, params: dict[int, Tree], x, y,
               throughput: bool = True) -> dict:
    """A timed run with the action clock (bubble, per-action durations, spans), then the step time
    and peak memory of a run without it, as torch's engine is timed (skipped with ``throughput=False``).
    ``models`` and ``params``: the split and this rank's weights by stage count."""
    schedule = build_schedule(name, ctx.world_size, args.microbatches, args.virtual_stages)
    pipe = build_pipeline(ctx, models[schedule.n_stages], schedule, x[0], dtype=args.torch_dtype,
                          params=params[schedule.n_stages])
    x, y = x.to(ctx.device), y.to(ctx.device)  # on the device before the step, as torch's engine gets them

    def step(timer):
        train_step(pipe, None, x, y, timer=timer)

    clocked = measure(step, args, ctx.device, ActionClock(ctx.device))
    result = {**clocked, "clocked_step_s": clocked["step_s"]}
    if throughput:
        result.update({k: v for k, v in measure(step, args, ctx.device).items() if k != "busy_s"})
    for p in pipe.parameters():
        p.grad = None
    return {"engine": "nanotrain", "schedule": name, "ours": name, "stages": schedule.n_stages,
            "theory": bubble_fraction(schedule), **result}


def bench_torch(ctx, models: dict[int, LayeredModel], spec: ModelSpec, name: str, args, params: dict[int, Tree], x,
                y, ours: dict | None) -> dict:
    step, n_stages = torch_pipeline_step(ctx, models, spec, name, args, params, x, y)
    result = measure(step, args, ctx.device)
    if ours and ours.get("busy_s") is not None:
        result["bubble_est"] = 1 - ours["busy_s"] / result["step_s"]
    return {"engine": "torch.pipelining", "schedule": TORCH[name], "ours": name, "stages": n_stages,
            "theory": ours["theory"] if ours else None, **result}


def main() -> None:
    args = parse_args()
    if args.device == "auto":
        need_cuda("tasks.bench.pipeline", "--device cpu")
    backend = "gloo" if args.device == "cpu" else None
    ctx = init_distributed(GridConfig(pp=launched_world_size()), backend, timeout_s=600)
    dtype = args.torch_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    spec = model_spec(preset(args.model, **({"n_layer": args.n_layer} if args.n_layer else {})))
    model = LayeredModel.from_spec(spec, args.seq, sublayers=args.layers == "sublayers")
    gen = torch.Generator().manual_seed(0)
    shape = (args.microbatches, args.micro_batch_size, args.seq)
    x = torch.randint(0, spec.vocab_size, shape, generator=gen)
    y = torch.randint(0, spec.vocab_size, shape, generator=gen)
    p = ctx.world_size
    if args.balance == "measured":
        model = balance_by_measurement(ctx, model, x[0], y[0], dtype)
    rounds = args.rebalance if args.rebalance is not None else 3 if args.balance == "measured" else 0
    if args.memory:
        rounds = 0  # the memory check needs no balance
    # A stage's measured correction holds for the layers measured together: each split refines its own costs.
    models = {n_stages: rebalanced(ctx, model, n_stages, rounds, args, x, y) if rounds else model
              for n_stages in (p, p * args.virtual_stages)}
    if ctx.rank == 0:
        how = args.balance + (", then rebalanced in the pipeline" if rounds else "")
        for n_stages, split in models.items():
            print(f"{n_stages} stages, balanced by {how}:\n{describe(partition(split, n_stages))}", flush=True)
    params = {n: random_params(ctx, models[n], n, dtype) for n in ((p,) if args.memory else models)}
    if args.memory:
        memory_check(ctx, models[p], args, params[p], spec)
        close_distributed(ctx)
        return
    engines = args.engines.split(",")
    schedules = args.schedules.split(",")
    if unknown := sorted(set(schedules) - set(OURS)):
        raise SystemExit(f"unknown schedule(s) {', '.join(unknown)} (known: {', '.join(OURS)})")
    rows: list[dict] = []
    with ctx.guard():
        for repeat in range(args.repeats):
            mine = []
            for name in schedules:
                ctx.where = f"the benchmark of nanotrain's {name}"
                if "ours" in engines:
                    mine.append(bench_ours(ctx, models, name, args, params, x, y))
                    rows.append({**mine[-1], "repeat": repeat})
                    save(ctx, args, rows)
            for name in schedules:
                # A schedule torch's engine cannot run stops every rank (with its error); results so far are saved.
                ctx.where = f"the benchmark of torch's {TORCH[name]}"
                if "torch" in engines:
                    ours = next((r for r in mine if r["schedule"] == name), None)
                    row = bench_torch(ctx, models, spec, name, args, params, x, y, ours)
                    rows.append({**row, "repeat": repeat})
                    save(ctx, args, rows)
                free_memory()
    if ctx.rank == 0:
        table = json.loads(args.out.read_text())["results"]
        print_table(args, spec, table)
        plot_timelines(args, table)
    close_distributed(ctx)


def rebalanced(ctx, model: LayeredModel, n_stages: int, rounds: int, args: argparse.Namespace, x: torch.Tensor,
               y: torch.Tensor) -> LayeredModel:
    """``model`` with costs refined from ``rounds`` short runs of the pipeline split ``n_stages`` ways.

    Each run is two warm-up steps and three timed steps of 1F1B (interleaved 1F1B beyond one stage
    per rank) with random weights (one step's stage times varied by about 1%); a stage's time is
    the sum of its actions' mean durations over the micro-batches and steps. Every rank gets every
    stage's time by an all-reduce of exact sums (each stage adds to zeros), so every rank refines
    alike and splits alike.
    """
    name = "1f1b" if n_stages == ctx.world_size else "interleaved-1f1b"
    short = argparse.Namespace(**{**vars(args), "warmup": 2, "steps": 3})
    measured: list[list[float]] = []

    def stage_ms(candidate: LayeredModel) -> list[float]:
        params = {n_stages: random_params(ctx, candidate, n_stages, args.torch_dtype)}
        row = bench_ours(ctx, {n_stages: candidate}, name, short, params, x, y, throughput=False)
        del params
        free_memory()
        times = torch.zeros(n_stages, dtype=torch.float64, device=ctx.device)
        for stage, _, ms in row["mean_ms"]:
            times[stage] += ms
        dist.all_reduce(times)
        measured.append(times.tolist())
        if ctx.rank == 0:
            print(f"rebalancing {n_stages} stages ({name}), round {len(measured) - 1}: ms per micro-batch "
                  f"{' / '.join(f'{ms:.2f}' for ms in measured[-1])}, slowest / mean "
                  f"{imbalance(measured[-1]):.4f}", flush=True)
        return measured[-1]

    ctx.where = f"rebalancing the {n_stages}-stage split"
    with ctx.guard():
        model, kept = rebalance(model, n_stages, stage_ms, rounds)
    if ctx.rank == 0:
        print(f"rebalancing {n_stages} stages: kept round {kept}'s split after {len(measured)} measured "
              f"(slowest / mean {imbalance(measured[kept]):.4f})", flush=True)
    return model


def memory_check(ctx, model: LayeredModel, args: argparse.Namespace, params: Tree, spec: ModelSpec) -> None:
    """Peak memory of one step above the weights: flat in the micro-batch count for 1F1B, linear for GPipe."""
    rows = []
    with ctx.guard():
        for name, micro in (("1f1b", 16), ("1f1b", 1000), ("gpipe", 16), ("gpipe", 64)):
            ctx.where = f"the memory check of {name} with {micro} micro-batches"
            shape = (micro, args.micro_batch_size, args.seq)
            x = torch.randint(0, spec.vocab_size, shape, generator=torch.Generator().manual_seed(0))
            pipe = build_pipeline(ctx, model, build_schedule(name, ctx.world_size, micro), x[0],
                                  dtype=args.torch_dtype, params=params)
            sync_ranks()
            base = torch.cuda.memory_allocated() / 2**30 if ctx.device.type == "cuda" else 0
            reset_peak(ctx.device, empty_cache=False)
            start = time.perf_counter()
            train_step(pipe, None, x, x)
            sync_ranks()
            peak = peak_gib(ctx.device) - base
            rows.append({"schedule": name, "microbatches": micro, "peak_above_weights_gib": peak,
                         "step_s": time.perf_counter() - start})
            for t in pipe.parameters():
                t.grad = None
    per_rank = gathered(ctx, rows)
    if ctx.rank == 0:
        print(f"\n{args.model}, micro-batches of {args.micro_batch_size} x {args.seq}: peak GiB above the weights")
        for i, row in enumerate(per_rank[0]):
            peaks = "/".join(f"{g[i]['peak_above_weights_gib']:.2f}" for g in per_rank)
            print(f"{row['schedule']:>6s} {row['microbatches']:5d} micro-batches: {peaks} per rank "
                  f"({row['step_s']:.1f} s)")
        save_json(args.out, {"memory": [[r[i] for r in per_rank] for i in range(len(rows))]}, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
