"""Time spans of a torch.profiler Chrome trace: how long communication ran, and how much of it ran alone.

Exposed communication is what a step waits for: the time in which a collective runs and nothing
else computes. On a GPU, the union of NCCL kernels minus the part overlapped by any other kernel;
on a CPU (gloo), the union of communication operators minus the part overlapped by other
operators. Spans are [start, end) in the trace's microseconds; results in milliseconds.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def union_ms(spans: list[tuple[float, float]]) -> float:
    """Total length (ms) of the union of [start, end) spans given in microseconds."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e3


def load_events(trace: str | Path) -> list[dict]:
    """The complete ("X") events of a Chrome trace."""
    return [e for e in json.loads(Path(trace).read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def communication_ms(events: list[dict], is_comm: Callable[[str], bool]) -> tuple[float, float]:
    """(communication time, exposed communication time) in ms: GPU kernels if the trace has any, else CPU ops."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    pool = kernels or [e for e in events if e.get("cat") == "cpu_op"]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in pool if is_comm(e["name"])]
    other = [(e["ts"], e["ts"] + e["dur"]) for e in pool if not is_comm(e["name"])]
    return union_ms(comm), union_ms(comm + other) - union_ms(other)
