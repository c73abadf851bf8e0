"""One dashboard for a distributed run: every rank's record gathered to the group's first rank.

Each rank of ``group`` wraps its sinks in ``GatherRanks`` (only the first rank needs any); each
step every rank hands in its record and the first rank writes one merged record: its own record
as the run's (loss, lr and speed are the run's on every rank), each rank's own measurements again
under ``rank<r>/<field>`` (step time, memory, GPU samples), and ``max_<field>`` over the ranks of
those, the number that says which rank is the bottleneck or the first to run out of memory.

It costs one small ``gather_object`` per step on ``group``; every rank must write every step.
"""
from __future__ import annotations

import torch.distributed as dist

from nanotrain.monitor.sinks import Sink

PER_RANK = ("step_s", "peak_gpu_gib", "gpu_alloc_gib", "gpu_reserved_gib", "rss_gib", "peak_rss_gib",
            "copy_wait_fraction", "gpu_util_pct", "gpu_power_w", "gpu_temp_c")


def merge_ranks(records: list[dict]) -> dict:
    """The first record, plus ``rank<r>/<field>`` and ``max_<field>`` of the per-rank fields."""
    merged = dict(records[0])
    for key in PER_RANK:
        values = [(r, rec[key]) for r, rec in enumerate(records) if rec.get(key) is not None]
        for r, v in values:
            merged[f"rank{r}/{key}"] = v
        if values:
            merged[f"max_{key}"] = max(v for _, v in values)
    return merged


class GatherRanks:
    def __init__(self, sinks: list[Sink], group: dist.ProcessGroup | None = None):
        self.sinks, self.group = sinks, group
        self.size = dist.get_world_size(group)
        self.first = dist.get_global_rank(group, 0) if group is not None else 0
        self.is_first = dist.get_rank() == self.first

    def write(self, record: dict) -> None:
        records = [None] * self.size if self.is_first else None
        dist.gather_object(record, records, dst=self.first, group=self.group)
        if self.is_first:
            merged = merge_ranks(records)
            for sink in self.sinks:
                sink.write(merged)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
