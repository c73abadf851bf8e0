"""Signals to runs with ranks: whichever process gets SIGTERM or Ctrl-C, every rank stops at the same step
boundary, saves, and ends by that signal (stopped early, not done); the built-in launcher passes signals on and
waits for the save, and no rank outlives its launcher, even one killed by SIGKILL; a lost rank is named with
what it was doing."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from nanotrain.distributed import spawn
from nanotrain.distributed.spawn import PARENT_DIED, Stopped
from nanotrain.core.train import loop
from nanotrain.core.train.loop import LoopConfig
from nanotrain.core.train.preempt import StopRequest
from nanotrain.run.lock import LOCK
from tests.conftest import REPO, SHAKESPEARE, TOKENIZER_DIR
from tests.core.test_loop import FakeTrainer, batches

TINY = ["--model", "tiny", "--batch", "4", "--seq", "32", "--data", str(SHAKESPEARE), "--tokenizer-dir",
        str(TOKENIZER_DIR), "--lr", "1e-3", "--no-tensorboard"]


def wait_for_stop(folder: str, save_s: float = 0.0) -> str:
    """A rank that waits for a stop request, saves for ``save_s``, says which signal it got and ends as a task does."""
    with StopRequest() as stop:
        Path(folder, f"ready-{os.environ['RANK']}").write_text(str(os.getpid()))
        deadline = time.monotonic() + 60
        while stop.signal is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(save_s)
    Path(folder, f"got-{os.environ['RANK']}").write_text(str(stop.name))
    stop.exit_if_stopped()
    return "not stopped"


def ready(folder: Path, n: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(list(folder.glob("ready-*"))) < n:
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.02)
    time.sleep(0.1)  # the pid file is written before the loop that waits
    return [int(p.read_text()) for p in sorted(folder.glob("ready-*"))]


def test_the_spawner_passes_a_signal_on_and_reports_the_stop(tmp_path):
    def send():
        ready(tmp_path, 2)
        os.kill(os.getpid(), signal.SIGTERM)  # to this process, the launcher: as `kill`, systemd, a container stop

    sender = threading.Thread(target=send)
    sender.start()
    with pytest.raises(Stopped) as info:
        spawn(wait_for_stop, 2, (str(tmp_path),), timeout_s=60, start_method="fork")
    sender.join()
    assert info.value.signal == signal.SIGTERM and info.value.exit_codes == [-signal.SIGTERM] * 2
    assert [p.read_text() for p in sorted(tmp_path.glob("got-*"))] == ["SIGTERM", "SIGTERM"]


LAUNCHER = """
import sys
from nanotrain.distributed import spawn
from tests.run.test_signals import wait_for_stop
spawn(wait_for_stop, 2, (sys.argv[1],), timeout_s=120, start_method="fork")
"""


def gone(pid: int) -> bool:
    """Exited (a zombie whose new parent has not reaped it counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_no_rank_outlives_a_launcher_killed_by_sigkill(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], cwd=REPO, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    ranks = ready(tmp_path, 2)
    try:
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 20
        while not all(gone(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(gone(pid) for pid in ranks)
        assert [p.read_text() for p in sorted(tmp_path.glob("got-*"))] == ["SIGTERM", "SIGTERM"]  # a clean stop
    finally:
        for pid in ranks:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_parent_death_signal_that_comes_twice_is_one_clean_stop(tmp_path):
    """A launcher with threads that dies hands its ranks from thread to thread, and the kernel signals each hand-over:
    under load a rank saw SIGTERM twice and exited unsaved. Two parent-death signals are one SIGTERM."""
    def send():
        ranks = ready(tmp_path, 2)
        for pid in ranks + ranks:  # the second while the ranks save: each handled apart, not merged into one pending
            os.kill(pid, PARENT_DIED)
            time.sleep(0.2)

    sender = threading.Thread(target=send)
    sender.start()
    with pytest.raises(Stopped) as info:
        spawn(wait_for_stop, 2, (str(tmp_path), 2.0), timeout_s=60, start_method="fork")
    sender.join()
    assert info.value.exit_codes == [-signal.SIGTERM] * 2
    assert [p.read_text() for p in sorted(tmp_path.glob("got-*"))] == ["SIGTERM", "SIGTERM"]


def test_a_signal_while_the_run_loads_stops_it_before_the_first_step(capsys):
    stop = StopRequest()
    stop.signal = signal.SIGTERM
    trainer = FakeTrainer([1.0])
    records = loop.run(trainer, batches(), LoopConfig(steps=1, sequences_per_step=2, seq_len=4), [],
                       torch.device("cpu"), save=lambda: pytest.fail("nothing to save"), stop=stop)
    assert records == [] and trainer.step_count == 0
    assert capsys.readouterr().out == "stopped by SIGTERM before the first step, at step 0: nothing trained, nothing " \
                                      "to save\n"


class Run:
    """A task run in its own session (as from a terminal or a scheduler), its output in a file."""

    def __init__(self, cwd: Path, *args: str):
        self.cwd, self.log = cwd, cwd / f"log-{time.monotonic_ns()}"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.text():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.05)

    def ranks(self) -> list[int]:
        """The launcher's children that run ranks (not multiprocessing's resource tracker)."""
        out = []
        for proc in Path("/proc").iterdir():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd = (proc / "cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.proc.pid and b"resource_tracker" not in cmd:
                out.append(int(proc.name))
        return out

    def finish(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture
def runs():
    started: list[Run] = []
    yield started
    for run in started:  # whatever is left of a failed test: the launcher's group, then its ranks' own
        ranks = run.ranks()
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "Ctrl-C to its process group"])
def test_dp_launcher_passes_the_signal_on_waits_for_the_save_and_ends_by_it(offline_files, tmp_path, runs, how):
    run = Run(tmp_path, "tasks.finetune", *TINY, "--dp", "2", "--steps", "100000", "--out", "dp")
    runs.append(run)
    run.wait_for("step     2 |")
    ranks = run.ranks()
    assert len(ranks) == 2
    sig = signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGINT
    if how.startswith("SIGTERM"):
        os.kill(run.proc.pid, sig)
    else:
        os.killpg(run.proc.pid, sig)  # what a terminal does; the ranks, in their own groups, get it once, passed on
    assert run.finish() == -sig, run.text()[-3000:]
    out = run.text()
    assert f"{sig.name}: stopping after this step and saving" in out and "Traceback" not in out, out[-3000:]
    assert "again: exiting now" not in out  # the signal reached each rank once
    step = int((tmp_path / "dp" / "latest").read_text().strip().removeprefix("step-"))
    assert f"saved dp/step-{step:06d}" in out and f"stopped by {sig.name} at step {step}" in out
    assert all(gone(pid) for pid in ranks)
    assert not (tmp_path / "dp" / LOCK).exists()  # the launcher held the run folder for its ranks, and let it go


def test_a_3d_run_saves_on_sigterm_to_its_group_and_resumes(offline_files, tmp_path, runs):
    args = ["tasks.finetune", *TINY, "--tp", "2", "--dp", "2", "--out", "run"]
    run = Run(tmp_path, *args, "--steps", "100000")
    runs.append(run)
    run.wait_for("step     2 |", timeout=120)
    os.killpg(run.proc.pid, signal.SIGTERM)  # as a scheduler sends it
    assert run.finish() == -signal.SIGTERM, run.text()[-3000:]
    out = run.text()
    step = int((tmp_path / "run" / "latest").read_text().strip().removeprefix("step-"))
    assert "Traceback" not in out and out.count("SIGTERM: stopping after this step") == 1, out[-3000:]
    assert f"stopped by SIGTERM at step {step} of 100000, saved in run; continue with:" in out
    again = Run(tmp_path, "tasks.finetune", "--out", "run", "--steps", str(step + 1), "--resume")
    runs.append(again)
    assert again.finish(120) == 0, again.text()[-3000:]
    assert f"resumed from run/step-{step:06d} at step {step}" in again.text()


def test_a_rank_killed_while_training_is_named_with_its_step_not_setup(offline_files, tmp_path, runs):
    # Steps of about a second, as real ones are: a rank publishes its phase with its heartbeat, every 0.5 s.
    run = Run(tmp_path, "tasks.finetune", *TINY, "--batch", "48", "--dp", "2", "--steps", "100000", "--out", "dp")
    runs.append(run)
    run.wait_for("step     3 |")
    os.kill(max(run.ranks()), signal.SIGKILL)  # the OOM killer's way: no message, no save
    assert run.finish() == 1
    out = run.text()
    assert "during setup" not in out and "Traceback" not in out, out[-3000:]
    assert re.search(r"rank 1 stopped responding \(no heartbeat[^)]*last seen in (step \d+|the [a-z ]+ after step "
                     r"\d+)[^)]*\)", out), out[-3000:]  # what the lost rank was doing, as far as it said
    assert re.search(r"rank 0 lost it during (step \d+|the [a-z ]+ after step \d+)", out), out[-3000:]
