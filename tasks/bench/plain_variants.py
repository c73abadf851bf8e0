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
from collections import defaultdict

import torch
import torch.nn.functional as F

from nanotrain.loss import VOCAB_ALIGN
from nanotrain.models import model_spec, preset
from tasks.bench.breakdown import kind_of
from tasks.bench.common import Row, peak_gib, reset_peak, time_steps
from tasks.bench.model import ours_step

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
    from torch.nn.attention import SDPBackend, sdpa_kernel
    (b, t), (h, _, d) = (16, 1024), spec.heads
    out = {}
    for name, be in {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                     "efficient": SDPBackend.EFFICIENT_ATTENTION}.items():
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


def variant(name, cfg, mb=16, compile_kw=None, ctx=None, **kw):
    """Time ``tasks.bench.model``'s plain step (each block compiled, or ``whole=True``) inside ``ctx``."""
    torch._dynamo.reset()
    reset_peak()
    try:
        with ctx or contextlib.nullcontext():
            t = time.time()
            step = ours_step(cfg, mb, 1024, True, compile_kw=compile_kw, **kw)
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
    from torch.profiler import ProfilerActivity, profile as tprof
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    t = time.time()
    with tprof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    wall = (time.time() - t) / 2
    cats, kern = defaultdict(float), defaultdict(lambda: [0.0, 0])
    total = 0.0
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            us = ev.device_time_total
            cats[kind_of(ev.name)] += us / 2e3
            kern[ev.name][0] += us / 2e3
            kern[ev.name][1] += 1
            total += us / 2e3
    top = sorted(kern.items(), key=lambda kv: -kv[1][0])[:40]
    log(f"profile {tag}: kernels {total:.1f} ms/step, wall (profiled) {wall * 1e3:.1f} ms/step")
    for c, ms in sorted(cats.items(), key=lambda kv: -kv[1]):
        log(f"   {c:34s} {ms:8.1f} ms")
    for nme, (ms, cnt) in top:
        log(f"   {ms:8.2f} ms  {cnt // 2:5d}x  {nme[:110]}")
    RES[f"profile_{tag}"] = {"kernel_ms": total, "wall_ms": wall * 1e3, "cats": dict(cats),
                             "top": [(n[:160], ms, c) for n, (ms, c) in top]}
    prof.export_chrome_trace(f"{OUT}/trace_{tag}.json")


def main():
    torch.backends.cuda.matmul.allow_tf32 = True
    log(torch.__version__, torch.cuda.get_device_name())
    cfg = preset("gpt2-large")
    if os.environ.get('MICRO'):
        gemms(model_spec(cfg))
        attention(model_spec(cfg))
    which = sys.argv[1].split(",") if len(sys.argv) > 1 else ["base", "prof", "cudnn", "chunk8k", "whole", "mb8",
                                                              "autotune"]
    from torch.nn.attention import SDPBackend, sdpa_kernel
    step = None
    for w in which:
        if time.time() - T0 > 480:
            log("time budget reached; skipping", w)
            continue
        if w == "base":
            step = variant("base compiled block mb16", cfg)
        elif w == "prof" and step is not None:
            profile(step, "base")
        elif w == "cudnn":
            variant("cudnn sdpa mb16", cfg, ctx=sdpa_kernel(SDPBackend.CUDNN_ATTENTION))
        elif w == "chunk8k":
            variant("head chunk 8192 mb16", cfg, chunk_tokens=8192)
        elif w == "whole":
            variant("whole body compiled mb16", cfg, whole=True)
        elif w == "mb8":
            variant("base mb8", cfg, mb=8)
        elif w == "mb24":
            variant("base mb24", cfg, mb=24)
        elif w == "autotune":
            variant("max-autotune-no-cudagraphs mb16", cfg, compile_kw={"mode": "max-autotune-no-cudagraphs"})
        json.dump(RES, open(f"{OUT}/explore21.json", "w"), indent=1)
    json.dump(RES, open(f"{OUT}/explore21.json", "w"), indent=1)


if __name__ == "__main__":
    main()
