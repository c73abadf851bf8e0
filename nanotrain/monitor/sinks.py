"""Metric sinks: each takes the loop's one record per step and shows or stores it.

A record is a flat dict of JSON values: ``step``, ``loss``, ``lr`` (None without a schedule),
``skipped``, ``step_s``, ``seq_per_s``, ``tokens_per_s``, ``trained_tokens`` and ``trained_tokens_per_s`` (the
targets in the loss: an instruction run's answer tokens), ``mfu`` (None without a known peak),
``peak_gpu_gib`` (None without a GPU), ``rss_gib``, ``peak_rss_gib``, ``copy_wait_fraction`` where
the trainer streams weights, the step's time split where the trainer measures it (``forward_s``,
``backward_s``, ``optimizer_s``, ``copy_wait_s`` as far as the trainer has copy waits, ``other_s`` the
rest of ``step_s``: ``monitor.steptime``), ``grad_norm`` and ``clipped`` where it clips, what loop hooks add
(``val_loss`` and ``val_ppl`` on validation steps, GPU samples) and ``eta_s``, the run's time left.
A new dashboard is a new sink, not a new loop.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Protocol


class Sink(Protocol):
    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


class StdoutSink:
    """A line per step (or every ``every`` steps and the first); fields that do not apply (no GPU, no
    known peak FLOP/s) are left out. ``prefix`` names the run when several share a terminal."""

    def __init__(self, every: int = 1, prefix: str = ""):
        self.every, self.prefix = every, prefix

    def write(self, r: dict) -> None:
        if r["step"] % self.every and r["step"] != 1 and r.get("val_loss") is None:
            return
        parts = [f"{self.prefix}step {r['step']:5d}", f"loss {r['loss']:.4f}"]
        if r.get("lr") is not None:
            parts.append(f"lr {r['lr']:.2e}")
        parts += [f"{r['seq_per_s']:.2f} seq/s", f"{r['tokens_per_s']:,.0f} tok/s"]
        if r.get("trained_tokens_per_s") is not None:  # targets in the loss: answers of instruction data
            parts.append(f"trained {r['trained_tokens_per_s']:,.0f} tok/s")
        if r.get("mfu") is not None:
            parts.append(f"MFU {100 * r['mfu']:.1f}%")
        if r.get("peak_gpu_gib") is not None:
            parts.append(f"GPU peak {r['peak_gpu_gib']:.2f} GiB")
        parts.append(f"RSS {r['rss_gib']:.2f} GiB (peak {r['peak_rss_gib']:.2f})")
        if r.get("copy_wait_fraction") is not None:
            parts.append(f"waits for copies {100 * r['copy_wait_fraction']:.1f}%")
        if r.get("grad_norm") is not None:
            parts.append(f"grad norm {r['grad_norm']:.3g}" + (" (clipped)" if r.get("clipped") else ""))
        if r.get("val_loss") is not None:
            parts.append(f"val loss {r['val_loss']:.4f} (ppl {r['val_ppl']:.1f})")
        if r.get("eta_s") is not None:
            parts.append(f"ETA {clock(r['eta_s'])}")
        note = "  SKIPPED (non-finite loss; weights unchanged)" if r["skipped"] else ""
        if r.get("overflow"):
            note = f"  SKIPPED (fp16 overflow at loss scale {r['loss_scale']:g}: backed off; weights unchanged)"
        print(" | ".join(parts) + note, flush=True)

    def close(self) -> None:
        pass


def clock(seconds: float) -> str:
    """``1:02:03``, ``2:03``."""
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _strict(value):
    """JSON has no NaN or infinity (``jq`` and browsers reject them): write null instead."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class JsonlSink:
    """Appends each record as a line of strict JSON to ``path``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps({k: _strict(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _step_of(line: str) -> float:
    """A record's step; a line torn by a kill mid-write counts as past every step (it is dropped)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def cut_jsonl(path: str | Path, last_step: int) -> int:
    """Drop the records past ``last_step`` (a resumed run writes them again); returns how many went.

    The file is rewritten under a temporary name and renamed over the old one.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _step_of(line) <= last_step]
    if len(kept) < len(lines):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)
    return len(lines) - len(kept)


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a metrics file, the last record of each step winning (resumed runs rewrite steps)."""
    by_step: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]
