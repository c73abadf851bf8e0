"""A plan is a value: which engine runs, on which layout, where masters and moments live, what is recomputed, in
which micro-batches, with which streaming tail; what it is predicted to take and hold. ``search.py`` picks it,
``tasks.plan`` and ``tasks.finetune`` print it, and the run's settings are the plan's for every flag not given."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from nanotrain.core.machine import GIB
from nanotrain.data_parallel.config import stage_name

ENGINES = ("resident", "streamed", "data-parallel", "3d")


@dataclass(frozen=True)
class Plan:
    engine: str          # one of ``ENGINES``
    micro_batch: int     # sequences per forward pass on each rank
    states: str          # where fp32 masters and AdamW's moments live: "gpu" or "cpu" (host memory)
    recompute: str       # the resident and 3D engines' policy; a streamed plan recomputes its layer-major blocks
    step_s: float        # predicted, one optimizer step
    gpu_bytes: int       # predicted allocated peak per GPU; it fits where ``core.footprint.margin`` of the cap is left
    host_bytes: int      # predicted peak of each process's host memory
    dp: int = 1
    zero: int = 0
    hold: bool = False   # ZeRO-3: each unit gathered once a step and held to its end (``DPConfig.hold``)
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    sp: bool = False
    tail: int | None = None              # streamed: the top blocks run with the head
    tail_micro_batch: int | None = None  # streamed: sequences per pass through the tail
    detail: Any = None   # the engine's own plan (``MemoryPlan``, ``ZeroPlan``, ``RankedPlan``, ``Prediction``)
    host_detail: str = ""  # the host peak's parts, where the engine's host model names them (``HostPlan.detail``)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def settings(self) -> dict[str, Any]:
        """The run's settings (argparse destinations) this plan decides."""
        out = {"micro_batch": self.micro_batch, "states": self.states, "recompute": self.recompute,
               "stream": self.engine == "streamed", "dp": self.dp, "zero": self.zero, "hold_weights": self.hold,
               "tp": self.tp, "pp": self.pp}
        if self.engine == "streamed":
            out |= {"tail": self.tail, "tail_micro_batch": self.tail_micro_batch}
        if self.engine == "3d":
            out |= {"schedule": self.schedule, "sp": self.sp}
        return out

    def flags(self) -> str:
        """The command-line flags that pin this plan (``tasks.finetune`` runs it with them as well as without)."""
        parts = [f"--micro-batch {self.micro_batch}"]
        if self.engine == "streamed":
            parts += ["--stream", f"--tail {self.tail}"]
            parts += [f"--tail-micro-batch {self.tail_micro_batch}"] if self.tail_micro_batch else []
        else:
            parts += [f"--states {self.states}", f"--recompute {self.recompute}"]
        parts += [f"--dp {self.dp}"] if self.dp > 1 else []
        parts += [f"--zero {self.zero}"] if self.zero else []
        parts += ["--hold-weights"] if self.hold else []
        if self.engine == "3d":
            parts += [f"--tp {self.tp}", f"--pp {self.pp}", f"--schedule {self.schedule}"]
            parts += ["--sp"] if self.sp else []
        return " ".join(parts)

    def layout(self) -> str:
        """Where the engine runs, in words."""
        stage = stage_name(self.zero, self.hold)
        return {"resident": "one GPU",
                "streamed": "weights streamed block by block" + (f", {self.dp} GPUs" if self.dp > 1 else ""),
                "data-parallel": f"{self.dp} GPUs, {stage}",
                "3d": f"tp {self.tp} x pp {self.pp} x dp {self.dp}, {self.schedule}"
                      + (f", {stage}" if self.dp > 1 else "")}[self.engine]

    def describe(self) -> str:
        """One line: the engine, its layout and choices, the predicted step and peaks."""
        layout = self.layout()
        if self.engine == "streamed":
            what = f"tail {self.tail}" + (f" in passes of {self.tail_micro_batch}" if self.tail_micro_batch else "")
        else:
            what = f"masters and moments on the {self.states}, recompute {self.recompute}"
        return (f"{self.engine} ({layout}): micro-batch {self.micro_batch}, {what}; step {self.step_s:.3f} s "
                f"predicted, GPU {self.gpu_bytes / GIB:.2f} GiB, host {self.host_bytes / GIB:.2f} GiB ({self.flags()})")

    def against(self, records: list[dict]) -> str | None:
        """The plan's step and peaks beside a run's (the loop's records, this process's: rank 0's GPU and host),
        each with the plan's error; None where the plan predicted no step (the CPU) or the run measured no GPU. The
        step is the median after the first two (compiling, filling the pipes), the peaks the run's."""
        if not self.step_s or not records or records[-1].get("peak_gpu_gib") is None:
            return None
        step = statistics.median(r["step_s"] for r in (records[2:] or records))
        gpu, host = (max(r[key] for r in records) * GIB for key in ("peak_gpu_gib", "peak_rss_gib"))

        def beside(measured: float, predicted: float, unit: str, scale: float = 1.0) -> str:
            return (f"{measured / scale:.3f}{unit} measured, {predicted / scale:.3f} predicted "
                    f"({(predicted / measured - 1) * 100:+.1f}%)")
        return (f"the plan against this run: step {beside(step, self.step_s, ' s')}; GPU peak (allocated) "
                f"{beside(gpu, self.gpu_bytes, ' GiB', GIB)}; host peak {beside(host, self.host_bytes, ' GiB', GIB)}")
