"""How every benchmark measures and reports (never used by the library): timed steps, throughput and MFU,
peak memory, a kernel-time profile, the result table and its JSON."""
from __future__ import annotations

import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from nanotrain.core.flops import mfu, peak_flops


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def need_cuda(task: str, smoke: str | None = None) -> None:
    """Refuse a benchmark of GPUs on a machine without one, before any work (gpt2-xl on the CPU runs for hours or
    is killed for memory): one ``error:`` line, from the first rank only, exit status 2. ``smoke``: the flag that
    runs it on the CPU as a smoke test of the harness instead."""
    if torch.cuda.is_available():
        return
    if int(os.environ.get("RANK", 0)) == 0:
        also = f"; {smoke} runs it on the CPU as a smoke test (its times mean nothing)" if smoke else ""
        print(f"error: {task} measures GPUs, and this machine has no CUDA GPU{also}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(step: Callable[[], None], warmup: int, steps: int, sync: Callable[[], None] = sync) -> float:
    """Seconds per call of ``step`` after ``warmup`` untimed calls, ``sync``ed at both ends (the device; a
    pipeline also waits for its peers)."""
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps


def time_windows(step: Callable[[], None], warmup: int, steps: int, windows: int) -> list[float]:
    """Seconds per call of ``step`` in each of ``windows`` consecutive windows of ``steps`` calls, after
    ``warmup`` untimed calls: their spread shows how far one window's figure can be trusted."""
    return [time_steps(step, warmup if i == 0 else 0, steps) for i in range(windows)]


def _cuda(device: torch.device | None) -> bool:
    return torch.cuda.is_available() if device is None else device.type == "cuda"


def reset_peak(device: torch.device | None = None, empty_cache: bool = True) -> None:
    """Start counting peak memory afresh; ``empty_cache`` also hands cached blocks back, so that the peak is
    this measurement's (off between warm-up and timed steps: re-allocating them would slow the first)."""
    if _cuda(device):
        if empty_cache:
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: torch.device | None = None) -> float:
    """Peak GPU memory allocated since the last reset (NaN without a GPU)."""
    return torch.cuda.max_memory_allocated() / 2**30 if _cuda(device) else float("nan")


def free_memory() -> None:
    """Free the last configuration's modules and states (reference cycles included) before the next."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def throughput(cfg: Any, seqs: int, seq: int, seconds: float, mfu_over: int = 1) -> dict[str, float | None]:
    """Sequences and tokens a second of ``seqs`` sequences of ``seq`` tokens in ``seconds``, and the MFU over
    ``mfu_over`` GPUs (None on a device without a known peak)."""
    tok_s = seqs * seq / seconds
    util = mfu(tok_s, cfg, seq, peak_flops(device_name()))
    return {"seq_per_s": seqs / seconds, "tokens_per_s": tok_s, "mfu": None if util is None else util / mfu_over}


def profile_table(name: str, step: Callable[[], None], warmup: int = 0, show: bool = True,
                  trace: str | None = None) -> None:
    """Print where the device time of two steps (after ``warmup``) goes, kernel by kernel; write their Chrome
    ``trace`` when given. Every rank of a distributed step must step (they talk); ``show`` says which prints."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
        sync()
    if trace:
        prof.export_chrome_trace(trace)
    if show:
        print(f"\n== profile: {name} ==")
        print(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                        row_limit=25, max_name_column_width=70))


@dataclass
class Row:
    """One measured configuration; ``extra`` holds anything task-specific."""
    name: str
    seq_per_s: float
    tokens_per_s: float
    mfu: float | None
    peak_gib: float
    extra: dict = field(default_factory=dict)

    @classmethod
    def measured(cls, name: str, cfg: Any, seqs: int, seq: int, seconds: float, peak: float, /,
                 mfu_over: int = 1, **extra) -> Row:
        """The row of ``seqs`` sequences of ``seq`` tokens in ``seconds`` (``throughput``), ``peak`` GiB."""
        return cls(name, **throughput(cfg, seqs, seq, seconds, mfu_over), peak_gib=peak, extra=extra)


def print_table(rows: list[Row], baseline: str | None = None,
                columns: dict[str, Callable[[Row], str]] | None = None) -> None:
    """One line per row: throughput, MFU, peak memory, seq/s over ``baseline``'s row when given, then the
    bench's own ``columns`` (header: a row's cell)."""
    base = next((r for r in rows if r.name == baseline), None)
    columns = columns or {}
    print(f"{'config':44s} {'seq/s':>8s} {'tok/s':>10s} {'MFU':>6s} {'peak GiB':>9s} {'ratio':>6s}"
          + "".join(f" {h:>10s}" for h in columns))
    for r in rows:
        util = f"{100 * r.mfu:5.1f}%" if r.mfu is not None else "  n/a"
        ratio = f"{r.seq_per_s / base.seq_per_s:6.2f}" if base else ""
        print(f"{r.name:44s} {r.seq_per_s:8.2f} {r.tokens_per_s:10.0f} {util:>6s} {r.peak_gib:9.2f} {ratio:>6s}"
              + "".join(f" {cell(r):>{max(10, len(h))}s}" for h, cell in columns.items()))


def save_json(path: str | Path, data: dict, indent: int = 2) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=indent))


def write_json(path: str | Path | None, rows: list[Row], **meta) -> None:
    if path is None:
        return
    meta.update(device=device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    save_json(path, {"meta": meta, "rows": [asdict(r) for r in rows]})
