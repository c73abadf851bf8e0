"""``--profile-steps A:B``: torch.profiler over steps A to B, a trace per rank and a text summary.

A loop hook: it starts the profiler (CPU, and CUDA where there is a GPU, with memory) just before
step A and stops it after step B, then writes ``trace-rank<r>.json`` (Chrome trace format: open it
at https://ui.perfetto.dev or chrome://tracing) and ``summary-rank<r>.txt``: the operators and
kernels taking the most time, the share of that time spent in communication (NCCL kernels on a
GPU, gloo and c10d operators on a CPU), and the exposed communication: the time in which a
collective ran and nothing else computed (``monitor.trace``), what overlap did not hide.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from nanotrain.monitor.trace import communication_ms, load_events

COMMUNICATION = ("nccl", "c10d", "gloo", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                 "broadcast", "send", "recv", "barrier")


def parse_steps(text: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B), steps counted from 1 as the progress line counts them."""
    try:
        first, last = (int(p) for p in text.split(":"))
    except ValueError:
        raise ValueError(f"--profile-steps {text!r}: expected FIRST:LAST, e.g. 5:7") from None
    if not 1 <= first <= last:
        raise ValueError(f"--profile-steps {text!r}: need 1 <= FIRST <= LAST")
    return first, last


def is_communication(name: str) -> bool:
    name = name.lower()
    return any(word in name for word in COMMUNICATION)


class StepProfiler:
    """Hook profiling steps ``first..last``; ``done_steps``: the trainer's step count before the loop."""

    def __init__(self, first: int, last: int, out_dir: str | Path, device: torch.device, rank: int = 0,
                 done_steps: int = 0):
        self.first, self.last, self.rank = first, last, rank
        self.out_dir = Path(out_dir)
        self.cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=activities, profile_memory=True, record_shapes=True)
        self._running, self._seen = False, done_steps
        if first <= done_steps:
            print(f"note: --profile-steps {first}:{last} lies before this run's step {done_steps + 1}: "
                  f"nothing profiled", flush=True)
        elif first == done_steps + 1:
            self._start()

    def _start(self) -> None:
        self._prof.start()
        self._running = True

    def __call__(self, step: int) -> dict:
        self._seen = step
        if self._running and step >= self.last:
            self._running = False
            if self.cuda:
                torch.cuda.synchronize()
            self._prof.stop()
            self.write()
        elif not self._running and step + 1 == self.first:
            self._start()
        return {}

    def close(self) -> None:
        """Stop and write what was recorded if the run ended inside the range (pre-empted, or shorter)."""
        if self._running:
            self.last = max(self.first, self._seen)  # the steps that did run
            self._running = False
            self._prof.stop()
            self.write()

    def write(self) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"trace-rank{self.rank}.json"
        self._prof.export_chrome_trace(str(trace))
        summary = self.out_dir / f"summary-rank{self.rank}.txt"
        comm, exposed = communication_ms(load_events(trace), is_communication)
        steps = self.last - self.first + 1
        summary.write_text(self.summary() + f"communication per step: {comm / steps:.1f} ms, of which exposed (nothing "
                                            f"else running) {exposed / steps:.1f} ms\n")
        print(f"profile of steps {self.first}-{self.last}: {trace} (open in https://ui.perfetto.dev), {summary}",
              flush=True)
        return trace

    def summary(self) -> str:
        events = self._prof.key_averages()
        key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        total = sum(getattr(e, key) for e in events)
        comm = sum(getattr(e, key) for e in events if is_communication(e.key))
        where = "GPU" if self.cuda else "CPU"
        head = (f"steps {self.first}-{self.last}, rank {self.rank}: {total / 1e3:.1f} ms of {where} self time, "
                f"{100 * comm / max(total, 1e-9):.1f}% of it in communication (overlapped or not: see the trace)\n\n")
        return head + events.table(sort_by=key, row_limit=25) + "\n"
