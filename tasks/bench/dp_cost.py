"""A cost model of data-parallel training beyond one machine: predicted step time and scaling.

    python -m tasks.bench.dp_cost --model gpt2-xl --seq-per-s 47.48 --per-gpu 64

Predictions, not measurements. Inputs: one GPU's measured forward+backward rate (``--seq-per-s``,
from ``tasks.bench.model``), sequences per GPU per step, and the link bandwidth each GPU sees to
the others (the slowest hop of the ring: NVLink inside a node, the NIC across nodes). The model:

* a ring all-reduce of B bytes over N ranks moves 2 (N-1)/N x B through every link; a ring
  all-gather or reduce-scatter moves (N-1)/N x B;
* DDP all-reduces fp32 gradients in buckets fired during backward (two thirds of the compute),
  so only what does not fit behind backward is exposed, plus the last bucket, which waits for the
  end of backward;
* ZeRO-3 all-gathers bf16 parameters before the forward of each unit and again before its
  backward, and reduce-scatters fp32 gradients: the forward gathers hide behind the forward
  (a third of the compute), the backward gathers and the reduce-scatters behind the backward;
  the first unit's gather of each pass is exposed.
"""
from __future__ import annotations

import argparse

from nanotrain.core.models import model_spec, preset
from nanotrain.compose.planner import ring_all_reduce_s
GBIT = 1e9 / 8  # bytes per second in one Gb/s


def ring_gather_s(nbytes: float, n: int, bandwidth: float) -> float:
    """All-gather or reduce-scatter of a buffer that is ``nbytes`` whole."""
    return (n - 1) / n * nbytes / bandwidth if n > 1 else 0.0


def ddp_step_s(params: int, n: int, bandwidth: float, compute_s: float, bucket_bytes: float = 25e6) -> float:
    comm = ring_all_reduce_s(4 * params, n, bandwidth)
    hidden_behind = 2 / 3 * compute_s
    return compute_s + max(comm - hidden_behind, 0.0) + ring_all_reduce_s(bucket_bytes, n, bandwidth)


def zero3_step_s(params: int, n: int, bandwidth: float, compute_s: float, units: int) -> float:
    gather = ring_gather_s(2 * params, n, bandwidth)       # bf16 parameters, once per pass
    scatter = ring_gather_s(4 * params, n, bandwidth)      # fp32 gradients
    first_unit = gather / units                            # nothing to overlap the first gather with
    forward = max(gather - compute_s / 3, 0.0) + first_unit
    backward = max(gather + scatter - 2 * compute_s / 3, 0.0) + first_unit
    return compute_s + forward + backward


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-xl")
    ap.add_argument("--seq-per-s", type=float, default=47.48,
                    help="one GPU's forward+backward rate (default: gpt2-xl on an H200, docs/BENCHMARKS.md)")
    ap.add_argument("--per-gpu", type=int, default=64, help="sequences per GPU per optimizer step")
    ap.add_argument("--gpus", default="2,4,8,16,32,64")
    ap.add_argument("--links-gbit", default="25,100,400", help="bandwidth per GPU in Gb/s")
    args = ap.parse_args(argv)
    cfg = preset(args.model)
    spec = model_spec(cfg)
    params, compute = spec.costs.total_params, args.per_gpu / args.seq_per_s
    print(f"{args.model}: {params / 1e9:.2f}B parameters, {args.per_gpu} sequences per GPU = {compute:.3f} s of "
          f"compute per step; predicted scaling efficiency (compute / step time):")
    print(f"{'GPUs':>5s} {'link':>9s} {'DDP step s':>11s} {'DDP eff':>8s} {'ZeRO-3 step s':>14s} {'ZeRO-3 eff':>11s}")
    for link in (float(x) for x in args.links_gbit.split(",")):
        for n in (int(x) for x in args.gpus.split(",")):
            ddp = ddp_step_s(params, n, link * GBIT, compute)
            z3 = zero3_step_s(params, n, link * GBIT, compute, units=len(spec.units))
            print(f"{n:5d} {link:6.0f} Gb {ddp:11.3f} {compute / ddp:8.1%} {z3:14.3f} {compute / z3:11.1%}")


if __name__ == "__main__":
    main()
