"""One search over every engine's footprint and step time for the machine at hand: the fastest plan that fits,
or a refusal naming what would.

``candidates.py`` asks each engine for the plans the pins leave open under both caps; this module ranks them by
predicted step time. What is not given is planned: above all ``--states gpu`` wherever masters and moments fit
beside the rest, since the host's AdamW is slower than the backward it should hide under (issue 37: 13% against
50% MFU).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable

from nanotrain.core.footprint import cap_for
from nanotrain.core.machine import GIB
from nanotrain.plan.candidates import RESIDENT_POLICIES, Ask, Box, resident, stream_job, stream_pins, streamed, streams
from nanotrain.plan.composed import composed
from nanotrain.plan.plan import Plan
from nanotrain.stream.search import smallest_caps


def search(ask: Ask, box: Box) -> list[Plan]:
    """Every plan that fits, fastest first (equal times: less recompute, the larger micro-batch, fewer bytes); a
    MemoryError naming the smallest caps or GPU count that work when none does."""
    plans = ranked(ask, box)
    if not plans:
        raise MemoryError(refusal(ask, box))
    return plans


def ranked(ask: Ask, box: Box) -> list[Plan]:
    """Every plan that fits, on each GPU count the run may take (``worlds``), fastest first: a plan over more GPUs
    ranks above one over fewer only where it is predicted faster, and at an equal time the fewer GPUs win.

    Streaming over several GPUs (ZeRO-Offload) is weighed where no plan at that count holds masters and moments on
    the GPUs, or where ``--stream`` is given. Where they fit, the resident engines' plans are the measured ones
    (llama-3.1-8b ZeRO-3 on 4 H200s, 2026-11-28: 1.48 s a step, 1.56 predicted), while ZeRO-Offload's step was
    measured once (gpt2-xl on 2 H200s, 2026-11-23: 1.72 s, 1.65 predicted today; ``docs/BENCHMARKS.md``), so a
    streamed plan predicted a few percent faster (that 8B model on 4 H100s: 1.90 s against ZeRO-3's 2.02) is not
    let displace them. Where they do not fit, it is the fast plan over several GPUs: qwen2.5-32b with 8-bit moments
    on 4 H100s is predicted 8.05 s a step against 30.6 s on one (not yet run)."""
    plans = []
    for gpus in worlds(ask, box):
        here = on(box, gpus)
        found = [q for engine in (resident, composed) for q in engine(ask, here)]
        if gpus == 1 or ask.pins.stream or not any(q.states == "gpu" for q in found):
            found += streamed(ask, here)
        plans += found
    order = {policy: i for i, policy in enumerate(RESIDENT_POLICIES)}  # lean's own recompute is left out of its time
    return sorted(plans, key=lambda q: (round(q.step_s, 6), q.world, order.get(q.recompute, 0), -q.micro_batch,
                                        q.gpu_bytes))


def worlds(ask: Ask, box: Box) -> range:
    """The GPU counts a plan may take: the one given (``Pins.gpus``), else any from 1 to the machine's."""
    return range(ask.pins.gpus, ask.pins.gpus + 1) if ask.pins.gpus else range(1, box.gpus + 1)


def on(box: Box, gpus: int) -> Box:
    """``box`` with ``gpus`` GPUs, one process each: each process's host cap the one given, or its even share of the
    host's memory (``node_host``) where that is less, so that a plan over several GPUs never asks the host for more
    than it has, all its processes together (each data-parallel rank loads its share:
    ``core.leaves.rank_load_bytes``)."""
    if box.node_host is None:
        return _with(box, gpus=gpus)
    share = box.node_host // gpus
    return _with(box, gpus=gpus, host_cap=share if box.host_cap is None else min(box.host_cap, share))


def refusal(ask: Ask, box: Box) -> str:
    """One line: nothing fits, and what would: the smallest GPU cap at this host cap (where the card has that much),
    the smallest host cap at this GPU cap, or the fewest GPUs (up to 64) at these caps."""
    asked = (f"{box.gpus} GPU{'s' if box.gpus > 1 else ''} of {box.gpu_cap / GIB:.1f} GiB"
             + ("" if box.host_cap is None else f" and a {box.host_cap / GIB:.1f} GiB host cap")
             + ("" if box.node_host is None else f" in the host's {box.node_host / GIB:.1f} GiB available"))
    fixes = []
    gpu, host = least_caps(ask, box)
    beyond = gpu is not None and box.card_bytes is not None and gpu > box.card_bytes  # no cap of this card reaches it
    if gpu is not None and not beyond:  # a cap named is rounded up: one rounded to the nearest tenth may be short of it
        fixes.append(f"--gpu-mem-gib {_tenth_up(gpu)}" + ("" if box.host_cap is None else " at this host cap"))
    if host is not None:
        fixes.append(f"--host-mem-gib {_tenth_up(host)}")
    more = next((g for g in (2, 4, 8, 16, 32, 64) if g > box.gpus and ask.batch % g == 0 and _fits(ask, box, gpus=g)),
                None)
    if more is not None:
        fixes.append(f"{more} GPUs")
    for name in ("states", "recompute", "micro_batch", "zero", "tail", "tail_micro_batch", "schedule", "stream"):
        given = getattr(ask.pins, name)
        if given not in (None, False) and (freed := _first(replace(ask, pins=replace(ask.pins, **{name: None})), box)):
            flag = f"--{name.replace('_', '-')}" + ("" if given is True else f" {given}")
            fixes.append(f"leaving out {flag} (planned: {freed.flags()})")
    bits = "; --adam-bits 8 halves the moments" if ask.adam_bits == 32 else ""
    none = f"no cap up to the card's {box.card_bytes / GIB:.1f} GiB" if beyond else "no cap"
    fix = " or ".join(fixes) if fixes else f"a shorter --seq or a smaller --batch ({none} fits these settings)"
    return (f"no plan of {ask.batch} x {ask.seq} fits {asked} with the settings given; the least that works: "
            f"{fix}{bits}")


def _tenth_up(cap: int) -> str:
    """``cap`` bytes in GiB, rounded up to a tenth."""
    return f"{math.ceil(cap / GIB * 10) / 10:.1f}"


def _first(ask: Ask, box: Box) -> Plan | None:
    return next(iter(ranked(ask, box)), None)


def _with(box: Box, **change: Any) -> Box:
    return Box(**(vars(box) | change))


def _fits(ask: Ask, box: Box, **change: Any) -> bool:
    trial = _with(box, **change)
    return any(any(True for _ in engine(ask, trial)) for engine in (resident, streamed, composed))


def least_caps(ask: Ask, box: Box) -> tuple[int | None, int | None]:
    """(the smallest GPU cap some plan meets at this host cap, the smallest host cap some plan meets at this GPU
    cap; None where none does): each engine's least, the resident one's by bisection (its plans are cheap), the
    streamed one's from its own enumeration, the 3D one's from its layouts' predicted bytes. GPU caps are sought
    within the host memory the search counts (``on``: a cap given, or the host's available share)."""
    held = on(box, box.gpus)
    gpus = [_bisect(lambda cap: any(True for _ in resident(ask, _with(held, gpu_cap=cap))), box.gpu_cap, 4096 * GIB)]
    gpus += [min((cap_for(q.gpu_bytes, box.expandable, q.world) for q in composed(ask, _with(held, gpu_cap=1 << 60))),
                 default=None)]
    hosts = [None if box.host_cap is None else _bisect(
        lambda cap: any(True for _ in resident(ask, _with(box, host_cap=cap))), box.host_cap, 1 << 50)]
    hosts += [None if box.host_cap is None else min((q.host_bytes for q in composed(ask, _with(box, host_cap=None))),
                                                    default=None)]
    if streams(ask, box) and not ask.lora:
        least = smallest_caps(stream_job(ask, box), box.gpu_cap, held.host_cap, *stream_pins(ask, box))
        gpus, hosts = gpus + [least[0]], hosts + [least[1] if box.host_cap is not None else None]
    elif streams(ask, box):  # the base model's streaming would overstate an adapted one's: its own plans, bisected
        some = lambda trial: any(True for _ in streamed(ask, trial))  # noqa: E731
        gpus += [_bisect(lambda cap: some(_with(held, gpu_cap=cap)), box.gpu_cap, 4096 * GIB)]
        hosts += [None if box.host_cap is None else _bisect(lambda cap: some(_with(box, host_cap=cap)), box.host_cap,
                                                            4096 * GIB)]
    return (min((g for g in gpus if g is not None), default=None),
            min((h for h in hosts if h is not None), default=None))


def _bisect(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The smallest cap (bytes, to 0.1 GiB) above ``low`` that ``fits``, by bisection; None if even ``high`` does
    not."""
    if not fits(high):
        return None
    while high - low > GIB // 10:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high
