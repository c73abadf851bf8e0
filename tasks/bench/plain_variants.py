"""Variants of the plain gpt2-large forward+backward (micro-batch 16), one process, one GPU, and a profile.

    MICRO=1 OUT=runs python -m tasks.bench.plain_variants base,prof,cudnn,chunk8k,mb24,whole,autotune

Each variant is timed after its first (compiling) step: ``base`` (each block compiled, as
``tasks.bench.model``), ``cudnn`` (SDPA forced to cuDNN), ``chunk8k`` (LM-head chunks of 8192 tokens),
``mb8``/``mb24``, ``whole`` (embeddings, blocks and final norm compiled as one graph) and ``autotune``
(``max-autotune-no-cudagraphs``: minutes of compiling). ``prof`` profiles ``base`` and writes
``OUT/trace_base.json`` (read it with ``tasks.bench.breakdown``). ``MICRO=1`` first measures the
block's GEMM shapes and the attention backends alone. Results: ``OUT/explore21.json``.
"""
import contextlib
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanotrain.core.loss import VOCAB_ALIGN
from nanotrain.core.models import model_spec, preset
from tasks.bench.breakdown import breakdown, print_breakdown
from tasks.bench.common import Row, need_cuda, peak_gib, profile_table, reset_peak, save_json, time_steps
from tasks.bench.model import SDPA, ours_step

OUT = os.environ.get("OUT", "/tmp")
RES = {}
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def gemms(spec):
    """TFLOP/s of each of a block's matmuls and the LM head's, at 16 x 1024 tokens."""
    m = 16 * 1024
    shapes = {key: spec.leaf(path).shape for key, path in zip(spec.block_keys, spec.block_units[0].paths)}
    sizes = {key: (shape[1], shape[0]) for key, shape in shapes.items() if len(shape) == 2}  # (in, out)
    sizes["head"] = (spec.costs.width, -(-spec.vocab_size // VOCAB_ALIGN) * VOCAB_ALIGN)
    out = {}
    for name, (k, n) in sizes.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        fl = 2 * m * k * n
        out[name] = {"fwd": fl / time_steps(lambda: F.linear(x, w), 3, 10) / 1e12,
                     "dgrad": fl / time_steps(lambda: g @ w, 3, 10) / 1e12,
                     "wgrad": fl / time_steps(lambda: g.t() @ x, 3, 10) / 1e12}
    log("gemm TFLOP/s", json.dumps(out, indent=0))
    RES["gemm_tflops"] = out


def attention(spec):
    (b, t), (h, _, d) = (16, 1024), spec.heads
    out = {}
    for name, be in SDPA.items():
        q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        go = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
        try:
            with sdpa_kernel(be):
                fwd = time_steps(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), 3, 10)

                def fb():
                    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    y.backward(go)
                fb_s = time_steps(fb, 3, 10)
            out[name] = {"fwd_ms": fwd * 1e3, "fwd_bwd_ms": fb_s * 1e3}
        except Exception as e:
            out[name] = repr(e)[:200]
    log(f"attention [{b},{h},{t},{d}]", out)
    RES["attention"] = out


# --variants: (row name, keyword arguments of ``variant``)
VARIANTS = {"base": ("base compiled block mb16", {}),
            "cudnn": ("cudnn sdpa mb16", {"attention": SDPBackend.CUDNN_ATTENTION}),
            "chunk8k": ("head chunk 8192 mb16", {"chunk_tokens": 8192}),
            "whole": ("whole body compiled mb16", {"whole": True}),
            "mb8": ("base mb8", {"mb": 8}),
            "mb24": ("base mb24", {"mb": 24}),
            "autotune": ("max-autotune-no-cudagraphs mb16", {"compile_kw": {"mode": "max-autotune-no-cudagraphs"}})}


def variant(name, cfg, mb=16, attention=None, **kw):
    """Time ``tasks.bench.model``'s plain step (each block compiled, or ``whole=True``; ``kw`` to ``ours_step``),
    SDPA restricted to the ``attention`` backend when given."""
    torch._dynamo.reset()
    reset_peak()
    try:
        with sdpa_kernel(attention) if attention else contextlib.nullcontext():
            t = time.time()
            step = ours_step(cfg, mb, 1024, True, **kw)
            step()
            torch.cuda.synchronize()
            comp = time.time() - t
            dt = time_steps(step, 2, 8)
        row = Row.measured(name, cfg, mb, 1024, dt, peak_gib())
        RES.setdefault("variants", {})[name] = {"seq_s": row.seq_per_s, "mfu": row.mfu, "compile_s": comp,
                                               "peak_gib": row.peak_gib}
        log(f"{name}: {row.seq_per_s:.2f} seq/s, MFU {100 * row.mfu:.1f}%, first step {comp:.0f}s, "
            f"peak {row.peak_gib:.1f} GiB")
        return step
    except Exception:
        log(f"{name}: FAILED\n{traceback.format_exc()[-1500:]}")
        RES.setdefault("variants", {})[name] = "failed"
        return None


def profile(step, tag):
    """Two profiled steps of ``step`` after two more: kernel by kernel, and their GPU time by kind
    (``tasks.bench.breakdown`` of the trace ``OUT/trace_<tag>.json``)."""
    trace = f"{OUT}/trace_{tag}.json"
    profile_table(tag, step, warmup=2, trace=trace)
    RES[f"profile_{tag}"] = breakdown(trace, steps=2)
    print_breakdown(f"profile {tag}", RES[f"profile_{tag}"], seqs=16)


def main():
    need_cuda("tasks.bench.plain_variants")
    torch.backends.cuda.matmul.allow_tf32 = True
    log(torch.__version__, torch.cuda.get_device_name())
    cfg = preset("gpt2-large")
    which = sys.argv[1].split(",") if len(sys.argv) > 1 else ["base", "prof", "cudnn", "chunk8k", "whole", "mb8",
                                                              "autotune"]
    if unknown := [w for w in which if w != "prof" and w not in VARIANTS]:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)} (known: prof, {', '.join(VARIANTS)})")
    if os.environ.get('MICRO'):
        gemms(model_spec(cfg))
        attention(model_spec(cfg))
    step = None
    for w in which:
        if time.time() - T0 > 480:
            log("time budget reached; skipping", w)
        elif w == "prof":
            if step is not None:
                profile(step, "base")
        else:
            done = variant(VARIANTS[w][0], cfg, **VARIANTS[w][1])
            step = done if w == "base" else step
        save_json(f"{OUT}/explore21.json", RES, indent=1)


if __name__ == "__main__":
    main()
