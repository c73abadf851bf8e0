"""Saves written on a thread while training goes on (``checkpoint.background.Saver``): the checkpoint holds the
state at the step it was taken, not the updates made while it was written, and resumes exactly; a ``kill -9``
during the write leaves ``latest`` on the checkpoint before, which resumes; a failed write is said at once and
raised at the next save; across 3 and 2 ranks every rank's shard is written and the publish comes after all, and a
write that fails on one rank (by any error) fails the save on every rank, none left waiting for it; the copies of
the ranks on one host share its available memory."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nanotrain.checkpoint import state as writer
from nanotrain.checkpoint import background
from nanotrain.checkpoint.background import Saver, _room
from nanotrain.checkpoint.disk import SaveFailed
from nanotrain.checkpoint.resume import load_masters, restore
from nanotrain.checkpoint.run_dir import find_checkpoint, remove_stale
from nanotrain.checkpoint.state import save_checkpoint
from nanotrain.core.machine import GIB, host_rss_gib
from nanotrain.core.models import init_params
from nanotrain.core.train.resident import ResidentTrainer
from nanotrain.data import DataPosition
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from tests.checkpoint.test_any_layout import ADAM, CFG, TCFG, batches, data_parallel
from nanotrain.core.optim import OffloadConfig

HOST = OffloadConfig(device="cpu", dtype=torch.float32, offload=True, state_bits=32)  # masters and moments on the host


def trainer() -> ResidentTrainer:
    return ResidentTrainer(CFG, init_params(CFG, seed=1), TCFG, ADAM, HOST)


def masters(t) -> dict[str, torch.Tensor]:
    return {k.removeprefix("master."): v.clone() for k, v in t.state_dict().items() if k.startswith("master.")}


def test_the_checkpoint_holds_the_step_it_was_taken_at_and_resumes_exactly(tmp_path):
    data = batches()
    first = trainer()
    first.step(*data[0])
    at_save = masters(first)
    saver = Saver(tmp_path)
    assert saver.save(first, DataPosition(0, 12)) == tmp_path / "step-000001"
    expected = [first.step(x, y).loss for x, y in data[1:]]  # updates the host masters the write reads
    saver.wait()
    first.close()
    saved = load_masters(find_checkpoint(tmp_path).path)
    assert all(torch.equal(saved[p], at_save[p]) for p in at_save)
    again = ResidentTrainer(CFG, init_params(CFG, seed=5), TCFG, ADAM, HOST)
    assert restore(again, tmp_path / "step-000001") == DataPosition(0, 12)
    assert [again.step(x, y).loss for x, y in data[1:]] == expected
    again.close()


def test_a_copy_over_the_host_cap_is_written_at_once(tmp_path, capsys):
    """Under ``--host-mem-gib`` with no room for the copy beside what the process holds, the save is written before
    training goes on (said in one line): published when ``save`` returns, no thread, the masters of that step."""
    first = trainer()
    first.step(*batches()[0])
    at_save = masters(first)
    saver = Saver(tmp_path, host_cap_gib=host_rss_gib()[0] + 0.5)  # under the copy's spare GiB
    assert saver.save(first, DataPosition(0, 12)) == tmp_path / "step-000001"
    assert saver._thread is None and find_checkpoint(tmp_path).path == tmp_path / "step-000001"
    assert "would not fit host memory (--host-mem-gib" in capsys.readouterr().out
    saved = load_masters(find_checkpoint(tmp_path).path)
    assert all(torch.equal(saved[p], at_save[p]) for p in at_save)
    first.close()


def test_a_failed_write_is_said_at_once_and_raised_at_the_next_save(tmp_path, monkeypatch, capsys):
    first = trainer()
    first.step(*batches()[0])
    saver = Saver(tmp_path)
    saver.save(first, DataPosition(0, 12))
    saver.wait()

    def full(path, *a, **k):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(writer, "write_tensors", full)
    first.step(*batches()[1])
    saver.save(first, DataPosition(0, 24))  # returns at once; the thread fails
    first.step(*batches()[2])
    with pytest.raises(SaveFailed, match="No space left on device"):
        saver.save(first, DataPosition(0, 36))
    assert "error: could not save: No space left on device" in capsys.readouterr().out
    first.close()
    assert (tmp_path / "latest").read_text() == "step-000001\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001"]  # the partial one removed


KILLED = """
import sys, time, torch
from pathlib import Path
from nanotrain.checkpoint import disk, state
from nanotrain.checkpoint import background
from nanotrain.checkpoint.background import Saver, _room
from nanotrain.data import DataPosition
from tests.checkpoint.test_background_save import batches, trainer

run = Path(sys.argv[1])
real = disk.write_tensors

def slow(path, specs, tensors):  # the write is under way: half the tensors out, then it hangs
    def trickle():
        for i, t in enumerate(tensors):
            if i == 3:
                (run / "writing").touch()
                time.sleep(600)
            yield t
    return real(path, specs, trickle())

t = trainer()
saver = Saver(run)
t.step(*batches()[0])
saver.save(t, DataPosition(0, 12))
saver.wait()
state.write_tensors = slow
t.step(*batches()[1])
saver.save(t, DataPosition(0, 24))
t.step(*batches()[2])  # training goes on while the write is under way
(run / "stepped").touch()
time.sleep(600)
"""


def test_kill_9_during_a_background_write_leaves_latest_on_the_checkpoint_before(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]), OMP_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(run)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not ((run / "writing").exists() and (run / "stepped").exists()):
            assert child.poll() is None and time.monotonic() < deadline, "the child died or hung before the write"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert (run / "latest").read_text() == "step-000001\n"
    assert [p.name for p in run.glob(".step-000002.tmp-*")]  # the killed write's partial folder
    assert find_checkpoint(run).path.name == "step-000001" and find_checkpoint(run).note is None
    assert remove_stale(run) and not list(run.glob(".*"))  # the next start removes it
    resumed = trainer()
    assert restore(resumed, run / "step-000001") == DataPosition(0, 12) and resumed.step_count == 1
    resumed.close()


def across_ranks(run: str) -> dict:
    """ZeRO-2: saved in the background at step 1 while steps 2 and 3 run, and synchronously at step 1 beside it;
    the next save waits for the one under way."""
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "gloo", timeout_s=60)
    data = batches()
    with ctx.guard():
        t = data_parallel(2, dist.group.WORLD, seed=1)
        t.step(*data[0])
        save_checkpoint(f"{run}/sync", t, DataPosition(0, 12))
        saver = Saver(Path(run) / "async")
        saver.save(t, DataPosition(0, 12))
        losses = [t.step(x, y).loss for x, y in data[1:]]
        saver.save(t, DataPosition(0, 36))  # waits for step 1's write first
        saver.wait()
        failed = one_rank_fails(t, Path(run) / "failing")
        room = rooms(dist.get_world_size())
        t.close()
        again = data_parallel(2, dist.group.WORLD, seed=4)
        restore(again, f"{run}/async/step-000001")
        resumed = [again.step(x, y).loss for x, y in data[1:]]
        again.close()
    close_distributed(ctx)
    return {"losses": losses, "resumed": resumed, "failed": failed, "room": room}


def rooms(world: int) -> tuple[bool, bool]:
    """Whether copies of a share each fit a host with 8 GiB available: the ranks on one host share it, so a share of
    8 / world GiB, which alone would fit, does not (with the GiB spare), and one 2 GiB smaller does."""
    real, background.host_available = background.host_available, lambda: 8 * GIB
    try:
        return _room(8 * GIB // world, dist.group.WORLD), _room((6 * GIB) // world, dist.group.WORLD)
    finally:
        background.host_available = real


def one_rank_fails(t, run: Path) -> str:
    """The last rank's write fails by no disk's error: every rank raises ``SaveFailed`` (none waits for it)."""
    def broken(*_):
        raise RuntimeError("a tensor it cannot write")

    real = writer.write_tensors
    if dist.get_rank() == dist.get_world_size() - 1:
        writer.write_tensors = broken
    saver = Saver(run)
    saver.save(t, DataPosition(0, 36))
    try:
        saver.wait()
    except SaveFailed as e:
        return str(e)
    finally:
        writer.write_tensors = real
    return "saved"


@pytest.mark.parametrize("world", [3, 2])
def test_every_rank_s_shard_is_written_in_the_background_and_published_after_all(tmp_path, world):
    for result in spawn(across_ranks, world, (str(tmp_path),), start_method="fork", timeout_s=120):
        assert result["resumed"] == result["losses"]  # the same layout: bit for bit
        assert result["failed"] == "could not save: RuntimeError: a tensor it cannot write"
        assert result["room"] == (False, True)
    sync, background = tmp_path / "sync" / "step-000001", tmp_path / "async" / "step-000001"
    assert sorted(p.name for p in background.iterdir()) == sorted(p.name for p in sync.iterdir())
    for name in (p.name for p in sync.iterdir() if p.suffix == ".safetensors" or p.name == "manifest.json"):
        assert (background / name).read_bytes() == (sync / name).read_bytes(), name
    assert (tmp_path / "async" / "latest").read_text() == "step-000003\n"
    assert not [p for p in (tmp_path / "async").iterdir() if p.name.startswith(".")]
    assert not list((tmp_path / "failing").iterdir())  # nothing published, what was written removed
