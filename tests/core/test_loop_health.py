"""The loop's guards with a scripted trainer: skipped steps stop a run before it saves, a blow-up is
warned about, a run at its last step does nothing, the host-memory guard, metrics without GPU fields."""
import json
import math

import pytest
import torch

from nanotrain.core.models import model_spec, preset
from nanotrain.core.loss import chunked_cross_entropy
from nanotrain.monitor import JsonlSink, StdoutSink, cut_jsonl
from nanotrain.core.train import loop
from nanotrain.core.train.health import TrainingStopped
from nanotrain.core.train.loop import LoopConfig
from nanotrain.core.train.result import StepResult
from nanotrain.core.train.step import batch_denominator


class Scripted:
    """A trainer whose losses are given in advance (NaN: a skipped step)."""

    def __init__(self, losses, start=0):
        self.losses, self.step_count = losses, start

    def step(self, tokens, targets):
        loss = self.losses[self.step_count]
        self.step_count += 1
        return StepResult(loss, not math.isfinite(loss), 1)


def run(losses, steps, start=0, **kw):
    saves = []
    trainer = Scripted(losses, start)
    lcfg = LoopConfig(steps=steps, sequences_per_step=1, seq_len=1, **kw)
    records = loop.run(trainer, lambda: (None, None), lcfg, [], torch.device("cpu"),
                       save=lambda: saves.append(trainer.step_count) or "saved")
    return records, saves


def test_consecutive_skipped_steps_stop_the_run_before_it_saves():
    nan = float("nan")
    with pytest.raises(TrainingStopped, match=r"3 steps in a row \(2..4\) had a non-finite loss"):
        run([10.0, nan, nan, nan] + [9.0] * 6, steps=10, save_every=2, max_skipped_steps=3)
    records, saves = run([10.0, nan, nan, 9.0, 8.0, 7.0], steps=6, max_skipped_steps=3)
    assert len(records) == 6 and saves == [6]  # two in a row is below the limit: the run goes on
    # a short run that diverged (lr 1e30: step 1 finite, then every step NaN) never reaches the limit
    with pytest.raises(TrainingStopped, match=r"the last 4 of this run's 5 steps .* not saving"):
        run([10.0] + [nan] * 4, steps=5)
    # no checkpoint on the cadence while steps are being skipped
    assert run([10.0, nan, 9.0, 8.0], steps=4, save_every=2)[1] == [4]


def test_a_loss_far_above_its_lowest_is_warned_about_once(capsys):
    run([10.0, 2.0, 1.0, 30.0, 40.0, 50.0, 60.0, 1.0], steps=8)
    out = capsys.readouterr().out
    assert out.count("warning: the loss has been above 10x its lowest (1) for 3 steps (now 50 at step 6)") == 1


def test_a_run_at_its_last_step_does_nothing_and_saves_nothing(capsys):
    records, saves = run([1.0] * 5, steps=3, start=3)
    assert records == [] and saves == []
    assert "nothing to do: the run is at step 3 of 3" in capsys.readouterr().out


def test_the_host_memory_guard_stops_the_run():
    with pytest.raises(loop.HostMemoryExceeded, match=r"went over --host-mem-gib 0.001 at step 1"):
        run([1.0] * 3, steps=3, host_mem_gib=0.001)


def test_records_without_a_gpu_have_no_gpu_fields_and_strict_json(tmp_path, capsys):
    trainer = Scripted([float("nan"), 1.5])
    sinks = [StdoutSink(), JsonlSink(tmp_path / "m.jsonl")]
    loop.run(trainer, lambda: (None, None), LoopConfig(steps=2, sequences_per_step=1, seq_len=1), sinks,
             torch.device("cpu"))
    sinks[1].close()
    out = capsys.readouterr().out
    assert "GPU" not in out and "nan" not in out.lower().replace("loss nan", "")
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]  # strict: no NaN
    assert rows[0]["loss"] is None and rows[0]["peak_gpu_gib"] is None and rows[0]["mfu"] is None


def test_cut_jsonl_drops_records_past_a_step_and_a_torn_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    assert cut_jsonl(path, 2) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert cut_jsonl(tmp_path / "absent.jsonl", 0) == 0


def test_targets_are_validated_keeping_the_ignore_index():
    cfg = preset("tiny")
    tokens = torch.zeros(1, 4, dtype=torch.long)
    assert batch_denominator(tokens, torch.tensor([[1, -100, 50256, 2]]), 1, cfg) == 3
    for bad in (50257, 50303, 60000, -1):  # inside the padded head, past it, negative
        with pytest.raises(ValueError, match=rf"target id {bad} is outside the vocabulary \[0, 50257\)"):
            batch_denominator(tokens, torch.tensor([[1, 2, bad, 3]]), 1, cfg)
        with pytest.raises(ValueError, match=rf"target id {bad} is outside"):
            chunked_cross_entropy(torch.randn(2, 8), torch.randn(50257, 8), torch.tensor([5, bad]))


def test_the_resident_host_plan_counts_what_lives_in_host_memory():
    from nanotrain.core.footprint import plan_resident_host
    from nanotrain.core.machine import CUDA_RUNTIME_BYTES, GIB
    from nanotrain.core.recompute import RecomputePolicy
    cfg, every = preset("gpt2-xl"), RecomputePolicy.parse("every")
    n = model_spec(cfg).costs.total_params
    gpu_states = plan_resident_host(cfg, 1, 1024, every, 32, False, True)
    assert gpu_states.total == CUDA_RUNTIME_BYTES  # masters and moments on the GPU: only CUDA's libraries
    offloaded = plan_resident_host(cfg, 1, 1024, every, 32, True, True)
    assert offloaded.total == CUDA_RUNTIME_BYTES + 16 * n  # fp32 masters + two fp32 moments + two bf16 copies
    assert plan_resident_host(cfg, 1, 1024, every, 8, True, True).total < offloaded.total - 5 * n
    cpu = plan_resident_host(cfg, 1, 1024, every, 32, True, False)
    assert cpu.total > 28 * n and cpu.total / GIB > 40  # fp32 everything: the 8 GiB run of the issue is refused
