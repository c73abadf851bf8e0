"""Where a step's GPU time goes, from a torch.profiler Chrome trace: kernels by kind, copies, idle gaps.

    python -m tasks.bench.breakdown runs/x/profile/trace-rank0.json --steps 2 --seqs 64 [--json out.json]

Kernels are grouped by name (matmuls, attention, fused elementwise and norms, the optimizer,
other); copies are the host<->device transfers. "GPU idle" is the time within the profiled span in
which no kernel runs on any stream (copies may still run): launch gaps and waits for copies. The
figures are per step (``--steps`` profiled) and per sequence (``--seqs`` a step). Recompute has no
kernel names of its own: compare a streamed step's matmul and attention time with the plain step's.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

from nanotrain.monitor.trace import load_events, union_ms
from tasks.bench.common import save_json

KINDS = (
    ("attention", ("flash", "fmha", "sdpa", "attn", "cudnn")),
    ("optimizer (AdamW)", ("adam", "lerp", "addcdiv", "quant", "amax_abs")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "wgmma", "splitk")),
    ("fused elementwise / norms", ("triton",)),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, words in KINDS:
        if any(w in low for w in words):
            return kind
    return "other kernels"


def breakdown(trace_path: str, steps: int) -> dict:
    events = load_events(trace_path)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset") and "Memset" not in e.get("name", "")]
    if not kernels:
        raise SystemExit(f"{trace_path}: no GPU kernels in this trace (was it profiled on a GPU?)")
    ks = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    cs = [(e["ts"], e["ts"] + e["dur"]) for e in copies]
    start, end = min(s for s, _ in ks + cs), max(e for _, e in ks + cs)
    by_kind: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_kind[kind_of(e["name"])] += e["dur"] / 1e3
    span = (end - start) / 1e3
    busy = union_ms(ks)
    copy_ms = sum(e - s for s, e in cs) / 1e3
    exposed_copy = union_ms(ks + cs) - busy
    per = {k: v / steps for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    return {"span_ms": span / steps, "busy_ms": busy / steps, "kernels_ms": per,
            "kernel_sum_ms": sum(by_kind.values()) / steps,
            "gpu_idle_ms": (span - busy) / steps, "copies_ms": copy_ms / steps,
            "copies_alone_ms": exposed_copy / steps, "kernel_count": len(kernels) / steps}


def print_breakdown(name: str, b: dict, seqs: int) -> None:
    print(f"\n{name}: {b['span_ms']:.1f} ms a step ({b['kernel_count']:.0f} kernels), {seqs} sequences; "
          f"ms a step and ms per sequence:")
    rows = list(b["kernels_ms"].items()) + [("GPU idle (no kernel on any stream)", b["gpu_idle_ms"]),
                                            ("host<->device copies (overlapped or not)", b["copies_ms"]),
                                            ("  of which with no kernel running", b["copies_alone_ms"])]
    for k, v in rows:
        print(f"  {k:44s} {v:9.1f} {v / seqs:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--steps", type=int, default=1, help="steps in each trace")
    ap.add_argument("--seqs", type=int, default=64, help="sequences a step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {}
    for t in args.traces:
        out[t] = breakdown(t, args.steps)
        print_breakdown(t, out[t], args.seqs)
    if args.json:
        save_json(args.json, out, indent=1)


if __name__ == "__main__":
    main()
