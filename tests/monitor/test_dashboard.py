"""The TensorBoard dashboard: event files read back with TensorBoard's own reader, a live TensorBoard
answering for them over HTTP, and a distributed run's records merged on its first rank."""
import json
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from nanotrain.core import models as M
from nanotrain.core.models import preset
from nanotrain.distributed import run_in_group, spawn
from nanotrain.distributed.spawn import free_port
from nanotrain.monitor import GatherRanks, NvmlSampler, TensorBoardSink
from nanotrain.monitor.ranks import merge_ranks
from nanotrain.core.train import loop
from tasks.demos.adapters import AutogradTrainer
from nanotrain.core.train.loop import LoopConfig
from tests.conftest import U32
from nanotrain.core.train.schedule import LRSchedule
from nanotrain.core.tree import named_leaves
pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

CFG = preset("tiny", n_layer=2, vocab_size=128)
CPU_TAGS = {"train/loss", "train/lr", "train/skipped_step", "speed/tokens_per_s", "speed/seq_per_s", "speed/step_s",
            "host/rss_gib", "host/peak_rss_gib", "time/forward_s", "time/backward_s", "time/optimizer_s",
            "time/other_s"}  # the resident trainer's step-time split (its copy waits are the optimizer's)


def tiny_run(log_dir, steps=4, first_step=0):
    """A few loop steps of a tiny GPT-2 on the CPU, logged to TensorBoard; the records."""
    params = M.init_params(CFG, seed=0)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    trainer = AutogradTrainer(params, lambda x, y: M.loss(params, x, y, CFG), torch.optim.AdamW(leaves), CFG)
    trainer.step_count = first_step
    g = torch.Generator().manual_seed(0)
    batch = lambda: (torch.randint(0, 128, (2, 8), generator=g),) * 2  # noqa: E731
    sink = TensorBoardSink(log_dir, first_step)
    schedule = LRSchedule(1e-3, "cosine", warmup_steps=1, decay_steps=steps)
    records = loop.run(trainer, batch, LoopConfig(steps, 2, 8, schedule=schedule), [sink], torch.device("cpu"))
    sink.close()
    return records


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_event_files_hold_the_records_under_their_tags(tmp_path):
    records = tiny_run(tmp_path)
    got = scalars(tmp_path)
    assert set(got) == CPU_TAGS  # no GPU: no GPU memory, NVML or MFU panels at all
    assert [s for s, _ in got["train/loss"]] == [1, 2, 3, 4]
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("speed/step_s", "step_s")):
        # an event file keeps a scalar in fp32: rounded to nearest, within fp32's unit roundoff of the record
        assert [v for _, v in got[tag]] == pytest.approx([r[key] for r in records], rel=U32)


def test_a_resumed_run_replaces_the_steps_past_its_checkpoint(tmp_path):
    tiny_run(tmp_path, steps=4)
    time.sleep(1.1)  # event file names carry the second they were made in
    tiny_run(tmp_path, steps=5, first_step=2)
    assert [s for s, _ in scalars(tmp_path)["train/loss"]] == [1, 2, 3, 4, 5]


def test_per_rank_and_maximum_tags(tmp_path):
    records = [{"step": 1, "loss": 2.0, "step_s": 0.5, "peak_gpu_gib": None, "rss_gib": 1.0},
               {"step": 1, "loss": 2.0, "step_s": 0.7, "peak_gpu_gib": None, "rss_gib": 3.0}]
    merged = merge_ranks(records)
    assert merged["rank1/step_s"] == 0.7 and merged["max_step_s"] == 0.7 and merged["max_rss_gib"] == 3.0
    assert "rank0/peak_gpu_gib" not in merged and "max_peak_gpu_gib" not in merged
    sink = TensorBoardSink(tmp_path)
    sink.write(merged)
    sink.close()
    assert {"train/loss", "speed/step_s", "rank0/speed/step_s", "rank1/speed/step_s", "max_over_ranks/speed/step_s",
            "rank1/host/rss_gib", "max_over_ranks/host/rss_gib"} <= set(scalars(tmp_path))


class _Keep:
    def __init__(self):
        self.rows = []

    def write(self, record):
        self.rows.append(record)

    def close(self):
        pass


def _gather(rank, world):
    keep = _Keep()
    sink = GatherRanks([keep] if rank == 0 else [])
    for step in (1, 2):
        sink.write({"step": step, "loss": 1.0, "step_s": float(rank + step), "rss_gib": 0.1 * rank})
    return keep.rows


def test_ranks_gather_on_the_first():
    per_rank = spawn(run_in_group, 3, ("gloo", _gather), timeout_s=60, start_method="fork")
    rows = per_rank[0]
    assert [r["step"] for r in rows] == [1, 2] and per_rank[1] == per_rank[2] == []
    assert [rows[1][f"rank{r}/step_s"] for r in range(3)] == [2.0, 3.0, 4.0] and rows[1]["max_step_s"] == 4.0


def test_no_gpu_means_no_sampler():
    assert NvmlSampler.start(torch.device("cpu")) is None


def test_tensorboard_serves_the_scalars_over_http(tmp_path):
    tiny_run(tmp_path / "run")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path), "--host",
                             "127.0.0.1", "--port", str(port), "--reload_interval", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, tags = time.monotonic() + 60, {}
        while time.monotonic() < deadline and not tags.get("run"):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5) as r:
                    tags = json.loads(r.read())
            except OSError:
                pass
            time.sleep(0.5)
        assert set(tags.get("run", {})) == CPU_TAGS, tags
        url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run=run&tag=train/loss"
        with urllib.request.urlopen(url, timeout=5) as r:
            assert [step for _, step, _ in json.loads(r.read())] == [1, 2, 3, 4]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class _FakeNvml:
    """NVML's calls as the sampler uses them, counting up so that means are checkable."""
    NVML_TEMPERATURE_GPU = 0

    def __init__(self):
        self.n = 0

    def nvmlDeviceGetUtilizationRates(self, handle):
        self.n += 1
        return type("Rates", (), {"gpu": self.n})

    def nvmlDeviceGetPowerUsage(self, handle):
        return 250_000  # milliwatts

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 60

    def nvmlShutdown(self):
        pass


def test_the_sampler_averages_what_its_thread_saw():
    nvml = _FakeNvml()
    sampler = NvmlSampler("handle", nvml, interval_s=0.01)
    time.sleep(0.2)
    first = sampler(1)
    seen = nvml.n
    assert seen >= 3 and first["gpu_power_w"] == 250.0 and first["gpu_temp_c"] == 60.0
    assert 1 <= first["gpu_util_pct"] <= seen  # the mean of 1..seen (or so, the thread runs on)
    sampler.close()
    sampler(0)  # what the thread saw before it stopped
    assert sampler(0)["gpu_util_pct"] == nvml.n  # nothing sampled since: one fresh sample
