"""The one training loop with a fake trainer and a recording sink, and the sinks themselves."""
from __future__ import annotations

import json
import math

import pytest
import torch

from nanotrain.monitor import JsonlSink, StdoutSink, read_jsonl
from nanotrain.core.train import loop
from nanotrain.core.train.loop import LoopConfig
from nanotrain.core.train.result import StepResult
class FakeTrainer:
    def __init__(self, losses: list[float], copy_wait_s: float | None = None):
        self.losses, self.copy_wait_s, self.step_count, self.seen = losses, copy_wait_s, 0, []

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> StepResult:
        self.seen.append(int(tokens[0, 0]))
        loss = self.losses[self.step_count]
        self.step_count += 1
        return StepResult(loss, not math.isfinite(loss), targets.numel(), copy_wait_s=self.copy_wait_s)


class Recorder:
    def __init__(self):
        self.records, self.closed = [], False

    def write(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        self.closed = True


def batches():
    n = 0

    def next_batch():
        nonlocal n
        n += 1
        return torch.full((2, 4), n), torch.zeros(2, 4, dtype=torch.long)
    return next_batch


def test_loop_steps_records_and_saves_on_its_cadence(capsys):
    trainer, sink, saved = FakeTrainer([3.0, 2.0, float("nan"), 1.5, 1.0], copy_wait_s=0.0), Recorder(), []
    lcfg = LoopConfig(steps=5, sequences_per_step=2, seq_len=4, flops_per_token=10.0, peak_flops=1e3, save_every=2)
    records = loop.run(trainer, batches(), lcfg, [sink], torch.device("cpu"),
                       save=lambda: saved.append(trainer.step_count) or f"ckpt-{trainer.step_count}")
    assert trainer.seen == [1, 2, 3, 4, 5] and sink.records == records
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and [r["skipped"] for r in records][2]
    assert saved == [2, 4, 5]  # on the cadence, and once at the end (not twice for step 4 of 4)
    r = records[0]
    assert r["tokens_per_s"] == pytest.approx(8 / r["step_s"]) and r["seq_per_s"] == pytest.approx(2 / r["step_s"])
    assert r["mfu"] == pytest.approx(r["tokens_per_s"] * 10.0 / 1e3) and r["peak_gpu_gib"] is None
    assert r["rss_gib"] > 0 and r["copy_wait_fraction"] == 0.0
    assert "saved ckpt-5" in capsys.readouterr().out


def test_a_finished_run_trains_nothing_and_saves_nothing(capsys):
    trainer, saved = FakeTrainer([1.0]), []
    trainer.step_count = 3
    assert loop.run(trainer, batches(), LoopConfig(3, 2, 4), [], torch.device("cpu"), save=saved.append) == []
    assert saved == [] and "nothing to do: the run is at step 3 of 3" in capsys.readouterr().out


def test_host_memory_guard_stops_the_loop():
    with pytest.raises(loop.HostMemoryExceeded, match=r"peak RSS .* went over --host-mem-gib 0.001 at step 1"):
        loop.run(FakeTrainer([1.0, 1.0]), batches(), LoopConfig(2, 2, 4, host_mem_gib=0.001), [], torch.device("cpu"))


def test_sinks_write_strict_json_and_leave_out_what_does_not_apply(tmp_path, capsys):
    trainer = FakeTrainer([2.0, float("nan"), 1.0])
    sinks = [StdoutSink(), JsonlSink(tmp_path / "m.jsonl")]
    loop.run(trainer, batches(), LoopConfig(3, 2, 4), sinks, torch.device("cpu"))
    sinks[1].close()
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert "NaN" not in "".join(lines) and json.loads(lines[1])["loss"] is None  # jq and browsers reject NaN
    out = capsys.readouterr().out
    assert "GPU" not in out and "MFU" not in out and "SKIPPED" in out.splitlines()[1]
    with open(tmp_path / "m.jsonl", "a") as f:  # a resumed run writes step 3 again: the last record wins
        f.write(json.dumps({"step": 3, "loss": 0.5}) + "\n")
    assert [r["loss"] for r in read_jsonl(tmp_path / "m.jsonl")] == [2.0, None, 0.5]
