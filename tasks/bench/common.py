"""Timing and reporting helpers shared by the benchmark tasks (never used by tests)."""
from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(step: Callable[[], None], warmup: int, steps: int) -> float:
    """Seconds per call of ``step`` after ``warmup`` untimed calls, device synchronised at both ends."""
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


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


@dataclass
class Row:
    """One measured configuration; ``extra`` holds anything task-specific."""
    name: str
    seq_per_s: float
    tokens_per_s: float
    mfu: float | None
    peak_gib: float
    extra: dict = field(default_factory=dict)


def print_table(rows: list[Row], baseline: str | None = None) -> None:
    base = next((r for r in rows if r.name == baseline), None)
    print(f"{'config':44s} {'seq/s':>8s} {'tok/s':>10s} {'MFU':>6s} {'peak GiB':>9s} {'ratio':>6s}")
    for r in rows:
        mfu = f"{100 * r.mfu:5.1f}%" if r.mfu is not None else "  n/a"
        ratio = f"{r.seq_per_s / base.seq_per_s:6.2f}" if base else ""
        print(f"{r.name:44s} {r.seq_per_s:8.2f} {r.tokens_per_s:10.0f} {mfu:>6s} {r.peak_gib:9.2f} {ratio}")


def write_json(path: str | Path | None, rows: list[Row], **meta) -> None:
    if path is None:
        return
    meta.update(device=device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
