"""Time ``adam_step`` per parameter, and how well ``OffloadAdam`` hides it behind the GPU.

    python -m tasks.bench.optim --params 100M --threads 16
    python -m tasks.bench.optim --overlap 300 --cases 32,8     # needs CUDA

Each case updates fp32 weights from a bf16 gradient and writes the bf16 weights for the device,
as the offloaded optimizer does: 32- or 8-bit moments, in place or into a second copy (what
``exact_skip`` does). One warm-up step, then ``--steps`` timed ones; the last column scales the time
to GPT-2-large (774M parameters). ``--device cuda`` times the on-device update instead.

``--overlap MS`` runs GPT-2-large's units through ``OffloadAdam`` against a stand-in GPU step: the
compute stream sleeps MS milliseconds of "backward", shared out over the units by size, calling
``update`` after each, then MS/2 of "forward" calling ``weights`` before each. It prints
the step time with and without the optimizer: equal times mean the update is fully hidden.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from nanotrain.core.models import model_spec, preset
from nanotrain.core.models.run import tree_from
from nanotrain.core.optim.adam import AdamConfig, adam_step, init_state
from nanotrain.core.optim import OffloadAdam, OffloadConfig
from nanotrain.core.optim.scratch import Scratch
from tasks.bench.common import need_cuda, time_steps

LARGE = model_spec(preset("gpt2-large"))  # the workload the times are scaled to
CASES = {"32": (32, False), "32-exact": (32, True), "8": (8, False), "8-exact": (8, True)}


def parse_count(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def time_case(n: int, bits: int, exact: bool, steps: int, device: str, chunk: int | None) -> float:
    """Seconds per step of one case."""
    p = torch.randn(n, device=device)
    g = torch.randn(n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, device=device, dtype=torch.bfloat16)
    state = init_state(p, bits)
    source = (p.clone(), init_state(p, bits)) if exact else None  # what an exact-skip step reads
    hp = AdamConfig(lr=1e-4, weight_decay=0.01)
    scratch, count = Scratch(), itertools.count(1)
    return time_steps(lambda: adam_step(p, g, state, hp, next(count), out=out, chunk=chunk, source=source,
                                        scratch=scratch), 1, steps)


def time_overlap(backward_ms: float, bits: int, exact: bool, steps: int) -> tuple[float, float]:
    """Seconds per stand-in step of GPT-2-large without and with the offloaded optimizer."""
    params = tree_from(LARGE, ((leaf.path, torch.full(leaf.shape, 0.01)) for leaf in LARGE.leaves))
    units = LARGE.unit_dict()
    opt = OffloadAdam(params, units, AdamConfig(), OffloadConfig(state_bits=bits, exact_skip=exact))
    grads = {u: [torch.randn_like(t) for t in opt.weights(u)] for u in units}
    share = {u: sum(g.numel() for g in gs) / LARGE.costs.total_params for u, gs in grads.items()}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**8)
    end.record()
    end.synchronize()
    cycles_per_ms = 10**8 / start.elapsed_time(end)

    def step(optimize: bool) -> None:
        for u in reversed(units):
            torch.cuda._sleep(int(backward_ms * share[u] * cycles_per_ms))
            if optimize:
                opt.update(u, grads[u])
        for u in units:
            if optimize:
                opt.weights(u)
            torch.cuda._sleep(int(backward_ms / 2 * share[u] * cycles_per_ms))

    time_steps(lambda: step(True), 0, steps)  # warm-up: first touch of the pinned buffers and the moments
    result = time_steps(lambda: step(False), 0, steps), time_steps(lambda: step(True), 0, steps)
    opt.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="100M", help="parameters per step, e.g. 100M")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=None, help="elements per chunk (default: adam.py's)")
    ap.add_argument("--cases", default="32,32-exact,8,8-exact", help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--overlap", type=float, default=None, metavar="MS", help="stand-in backward time in ms")
    args = ap.parse_args()
    if args.device != "cpu" or args.overlap is not None:  # the stand-in backward is a GPU sleep
        need_cuda(f"tasks.bench.optim {'--overlap' if args.overlap is not None else '--device ' + args.device}",
                  "--device cpu without --overlap")
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown} (known: {', '.join(CASES)})")
    torch.set_num_threads(args.threads)
    if args.overlap is not None:
        print(f"GPT-2-large through OffloadAdam, {args.threads} threads, backward {args.overlap:.0f} ms "
              f"+ forward {args.overlap / 2:.0f} ms per step")
        for case in args.cases.split(","):
            plain, offloaded = time_overlap(args.overlap, *CASES[case], args.steps)
            print(f"{case:>9}: {plain * 1e3:7.1f} ms/step compute only, {offloaded * 1e3:7.1f} ms/step with the "
                  f"optimizer ({offloaded / plain:.2f}x)")
        return
    n = parse_count(args.params)
    print(f"{n / 1e6:.0f}M parameters, {args.threads} threads, device {args.device}, torch {torch.__version__}")
    print(f"{'case':>9} {'s/step':>8} {'ns/param':>9} {'Mparam/s':>9} {'GPT-2-large s':>14}")
    for case in args.cases.split(","):
        bits, exact = CASES[case]
        sec = time_case(n, bits, exact, args.steps, args.device, args.chunk)
        large_s = sec / n * LARGE.costs.total_params
        print(f"{case:>9} {sec:8.3f} {sec / n * 1e9:9.2f} {n / sec / 1e6:9.0f} {large_s:14.2f}")


if __name__ == "__main__":
    main()
