"""``tasks.bench.pipeline``'s results: every rank's rows gathered and saved as they come, combined into one per
benchmark (the slowest rank's step, each rank's peak, the bubbles measured, replayed on paper and in theory), printed
with ours over torch's ratios, and each of our schedules' last measured step drawn as a timeline."""
from __future__ import annotations

import argparse
import statistics

import torch.distributed as dist

from nanotrain.core.models import ModelSpec
from nanotrain.monitor.plot import plot_timeline
from nanotrain.pipeline import bubble_fraction, build_schedule
from nanotrain.pipeline.timeline import makespan
from tasks.bench.common import save_json


def gathered(ctx, rows: list[dict]) -> list[list[dict]]:
    """Every rank's rows, on every rank."""
    out = [None] * ctx.world_size
    dist.all_gather_object(out, rows)
    return out


def save(ctx, args: argparse.Namespace, rows: list[dict]) -> None:
    """Gather every rank's rows and (rank 0) rewrite the JSON, so a later failure loses nothing."""
    per_rank = gathered(ctx, rows)
    if ctx.rank == 0:
        config = {k: str(v) for k, v in vars(args).items() if k != "torch_dtype"}
        save_json(args.out, {"config": config, "results": combine(args, per_rank)}, indent=1)


def combine(args: argparse.Namespace, per_rank: list[list[dict]]) -> list[dict]:
    """One row per benchmark: the slowest rank's step time, every rank's peak memory, mean bubble.

    For our schedules also the schedule replayed on paper with each stage's measured F/B/I/W
    durations: its bubble, and its step time (the ideal step), what an engine with free, instant
    messages would reach with these stages. The gap to it is the engine's own (messages, waits,
    launches). And the theory at measured durations: the replay with every stage's durations
    replaced by their mean over stages (equal stages, the measured ratios of I and W to F), the
    theory without the split's imbalance.
    """
    tokens = args.microbatches * args.micro_batch_size * args.seq
    table = []
    for i, row in enumerate(per_rank[0]):
        ranks = [r[i] for r in per_rank]
        step_s = max(r["step_s"] for r in ranks)
        busy = [r["busy_s"] for r in ranks if r.get("busy_s") is not None]
        clocked_s = max(r.get("clocked_step_s", r["step_s"]) for r in ranks)  # the step the busy times are from
        entry = {
            "engine": row["engine"], "schedule": row["schedule"], "ours": row["ours"], "repeat": row["repeat"],
            "stages": row["stages"],
            "tokens_per_s": tokens / step_s, "step_ms": 1e3 * step_s,
            "peak_gib_per_rank": [r["peak_gib"] for r in ranks],
            "bubble_measured": (1 - sum(busy) / len(busy) / clocked_s) if busy else None,
            # The theory assumes equal stages; the busiest rank's idle time is the schedule's and the
            # engine's bubble without the split's imbalance (which the mean over ranks includes).
            "bubble_busiest": (1 - max(busy) / clocked_s) if busy else None,
            "bubble_estimated": (sum(r["bubble_est"] for r in ranks) / len(ranks)) if "bubble_est" in row else None,
            "bubble_theory": row["theory"],
        }
        if busy:
            mean_ms = {(stage, kind): ms for r in ranks for stage, kind, ms in r["mean_ms"]}
            schedule = build_schedule(row["schedule"], len(ranks), args.microbatches, args.virtual_stages)
            entry["busy_ms_per_rank"] = [1e3 * b for b in busy]
            entry["mean_ms_by_stage_kind"] = {f"{stage}{kind}": ms for (stage, kind), ms in sorted(mean_ms.items())}
            entry["bubble_replayed"] = bubble_fraction(schedule, lambda a: mean_ms[(a.stage, a.kind)])
            entry["ideal_step_ms"] = makespan(schedule, lambda a: mean_ms[(a.stage, a.kind)])
            means = {k: statistics.mean(ms for (_, kind), ms in mean_ms.items() if kind == k)
                     for k in {kind for _, kind in mean_ms}}
            entry["bubble_theory_measured"] = bubble_fraction(schedule, means)
            entry["spans_per_rank"] = [r["spans"] for r in ranks]
        table.append(entry)
    return table


def plot_timelines(args: argparse.Namespace, table: list[dict]) -> None:
    """A Gantt chart of the last timed step of each of our schedules, beside the JSON."""
    for r in table:
        if "spans_per_rank" in r and r["repeat"] == args.repeats - 1:
            ranks = [[(kind, mb, start, end) for kind, mb, _, start, end in spans] for spans in r["spans_per_rank"]]
            title = (f"nanotrain {r['schedule']}: one measured step, bubble {r['bubble_measured']:.1%} "
                     f"(replayed {r['bubble_replayed']:.1%}, theory {r['bubble_theory']:.1%})")
            plot_timeline(ranks, args.out.parent / f"{args.out.stem}-{r['schedule']}.png", title)


def print_table(args: argparse.Namespace, spec: ModelSpec, table: list[dict]) -> None:
    print(f"\n{args.model} ({spec.n_layer} layers), {args.microbatches} micro-batches of "
          f"{args.micro_batch_size} x {args.seq} tokens, {args.dtype}")
    print(f"{'engine':>17s} {'schedule':>30s} {'stages':>6s} {'tokens/s':>10s} {'step ms':>8s} {'of ideal':>8s} "
          f"{'peak GiB per rank':>24s} {'bubble':>7s} {'busiest':>7s} {'replay':>7s} {'theory':>7s} {'at meas.':>8s}")
    ideal = {(r["ours"], r["repeat"]): r["ideal_step_ms"] for r in table if "ideal_step_ms" in r}

    def pct(r: dict, key: str) -> str:
        return "-" if r.get(key) is None else f"{r[key]:.1%}"

    for r in table:
        shown = (pct(r, "bubble_measured") if r["bubble_measured"] is not None
                 else "-" if r["bubble_estimated"] is None else "~" + pct(r, "bubble_estimated"))
        key = (r["ours"], r["repeat"])
        of_ideal = f"{ideal[key] / r['step_ms']:.3f}" if key in ideal else "-"
        peaks = "/".join(f"{g:.1f}" for g in r["peak_gib_per_rank"])
        print(f"{r['engine']:>17s} {r['schedule']:>30s} {r['stages']:6d} {r['tokens_per_s']:10.0f} "
              f"{r['step_ms']:8.1f} {of_ideal:>8s} {peaks:>24s} {shown:>7s} {pct(r, 'bubble_busiest'):>7s} "
              f"{pct(r, 'bubble_replayed'):>7s} {pct(r, 'bubble_theory'):>7s} {pct(r, 'bubble_theory_measured'):>8s}")
        if "busy_ms_per_rank" in r:
            kinds = ", ".join(f"{k} {ms:.2f}" for k, ms in r["mean_ms_by_stage_kind"].items())
            print(f"{'':>17s} busy ms per rank {'/'.join(f'{b:.1f}' for b in r['busy_ms_per_rank'])}; "
                  f"mean ms per stage and kind: {kinds}")
    print("of ideal: the step time of our schedule replayed on paper with each stage's measured durations and free "
          "messages, over this step time; bubble: measured from CUDA events for nanotrain, mean over ranks; busiest: "
          "the idle share of the rank with the most compute, i.e. without the split's imbalance; ~ estimated for torch "
          "from its step time and our compute time for the same schedule; replay: our schedule on paper with the "
          "measured durations of each stage's actions and free messages; theory: unit-cost timeline, F=1, B=2, I=W=1; "
          "at meas.: the same timeline with each kind's measured duration averaged over stages")
    print_ratios(table)
    print(f"wrote {args.out}")


def print_ratios(table: list[dict]) -> None:
    """Ours over torch's tokens/s for each schedule, one per repeat, and their median."""
    for name in dict.fromkeys(r["ours"] for r in table):
        pairs = {}
        for r in table:
            if r["ours"] == name:
                pairs.setdefault(r["repeat"], {})[r["engine"]] = r["tokens_per_s"]
        ratios = [p["nanotrain"] / p["torch.pipelining"] for p in pairs.values() if len(p) == 2]
        if ratios:
            print(f"{name}: nanotrain / torch tokens/s {', '.join(f'{x:.4f}' for x in ratios)} "
                  f"(median {statistics.median(ratios):.4f})")
