"""Launching data parallelism with torchrun on the CPU: two "nodes" on localhost with c10d rendezvous,
and an elastic restart after a worker is killed; both end with the single-process run's losses."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotrain.distributed import free_port
from nanotrain.core.models import preset
from tests.conftest import REPO, SHAKESPEARE, TOKENIZER_DIR
from tests.task_losses import assert_task_losses, metrics

COMMON = ["--model", "tiny", "--batch", "8", "--micro-batch", "2", "--seq", "32", "--recompute", "every",
          "--data", str(SHAKESPEARE), "--tokenizer-dir", str(TOKENIZER_DIR), "--lr", "1e-3",
          "--save-every", "1", "--keep-last", "0"]  # every step's weights, which bound the next losses (task_losses)



@pytest.fixture
def launched():
    """The torchrun processes a test starts; whatever is left of them (their workers too) is killed at its end."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def torchrun(procs: list, cwd: Path, launcher: list[str], task: list[str], log: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with open(cwd / log, "w") as out:
        procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launcher, "-m",
                                       "tasks.finetune", *task], cwd=cwd, env=env, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs[-1]


def finish(proc: subprocess.Popen, cwd: Path, log: str, timeout: float = 120) -> None:
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = "still running"
    assert code == 0, (code, (cwd / log).read_text()[-5000:])


def reference(steps: int) -> None:
    from tasks.finetune import main
    main(COMMON + ["--steps", str(steps), "--out", "one"])


def test_two_nodes_on_localhost_give_the_single_process_losses(offline_files, tmp_path, monkeypatch, launched):
    monkeypatch.chdir(tmp_path)
    reference(3)
    port = free_port()
    nodes = [torchrun(launched, tmp_path, ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes"],
                      COMMON + ["--steps", "3", "--out", "dp", "--dp", "4", "--zero", "2"], f"node{k}.log")
             for k in range(2)]
    for k, node in enumerate(nodes):
        finish(node, tmp_path, f"node{k}.log")
    assert_task_losses(tmp_path / "dp", tmp_path / "one", preset("tiny"), 32, 8 * 32)


def test_a_killed_worker_restarts_the_group_which_resumes_from_the_last_checkpoint(offline_files, tmp_path,
                                                                                    monkeypatch, launched):
    monkeypatch.chdir(tmp_path)
    steps = 30
    reference(steps)
    proc = torchrun(launched, tmp_path, ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"],
                    COMMON + ["--steps", str(steps), "--out", "dp", "--dp", "2", "--zero", "1"],
                    "elastic.log")
    deadline = time.monotonic() + 90
    while not (tmp_path / "dp" / "latest").is_file() or max(metrics(tmp_path / "dp"), default=0) < 6:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "elastic.log").read_text()[-5000:]
        time.sleep(0.05)
    workers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == proc.pid]
    assert len(workers) == 2
    os.kill(max(workers), signal.SIGKILL)  # one of the workers this test's torchrun started
    finish(proc, tmp_path, "elastic.log")
    log = (tmp_path / "elastic.log").read_text()
    assert "resumed from dp/step-0000" in log, log[-5000:]
    assert_task_losses(tmp_path / "dp", tmp_path / "one", preset("tiny"), 32, 8 * 32)


def _parent(proc_dir: Path) -> int | None:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


@pytest.mark.parametrize("rank,here,during,after", [(None, False, True, True), ("0", False, True, True),
                                                    ("1", False, False, False), ("0", True, False, True),
                                                    ("1", True, False, False)])
def test_the_first_rank_alone_speaks_and_local_ranks_not_twice(rank, here, during, after, monkeypatch, capsys):
    """Ranks after the first print nothing; processes started here repeat their launcher's checks (and its
    plan table) before they join, so their first rank is quiet until then."""
    from nanotrain.data_parallel.launch import STARTED_HERE, mute_other_ranks

    for name, value in (("RANK", rank), (STARTED_HERE, "1" if here else None)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    shown = sys.stdout
    try:
        speak = mute_other_ranks()
        print("checks")
        speak()
        print("training")
    finally:
        sys.stdout = shown
    assert capsys.readouterr().out == "checks\n" * during + "training\n" * after
