import os
import signal
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
TOKENIZER_DIR = SHARED_DATA / "gpt2-tokenizer"
SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"


@pytest.fixture(autouse=True)
def _single_thread_determinism():
    torch.manual_seed(0)
    yield


@pytest.fixture
def offline_files():
    """Skip a test that runs a task on the real tokenizer files and corpus when ../shared/data lacks them."""
    if not (TOKENIZER_DIR.is_dir() and SHAKESPEARE.exists()):
        pytest.skip("needs ../shared/data (tokenizer files and tinyshakespeare)")


@pytest.fixture
def tokenizer():
    if not TOKENIZER_DIR.is_dir():
        pytest.skip(f"tokenizer files not found at {TOKENIZER_DIR}")
    from nanotrain.tokenizer import get_tokenizer
    return get_tokenizer(str(TOKENIZER_DIR))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: one number per tensor, robust to individual near-zero entries."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def kill_self(sig: int = signal.SIGKILL) -> None:
    """Die as ``kill -9`` or the OOM killer kills: no exception, no report, no exit handlers. With
    ``signal.SIGSTOP``, hang instead: the peers' gloo waits then get no error, as under NCCL they get none
    when a rank is killed, and only the failure watch's heartbeat can tell."""
    os.kill(os.getpid(), sig)


def assert_killed_rank_named(fn: Callable, world: int, killed: int, args: tuple = (), within_s: float = 60,
                             grace_s: float | None = None) -> float:
    """Run ``fn(*args)`` on ``world`` forked ranks, of which ``killed`` kills (or stops) itself: every other rank
    must exit by itself with code 1 (its failure watch or guard, not the spawner's kill) within ``within_s``,
    and its output must name the killed rank. ``grace_s``: how long the spawner waits for the others once one
    has exited (all of it when a rank is stopped, not dead). Returns the seconds the run took."""
    from nanotrain.distributed import SpawnError, spawn

    start = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(fn, world, args, timeout_s=2 * within_s, start_method="fork", grace_s=grace_s or within_s)
    elapsed = time.monotonic() - start
    codes = info.value.exit_codes
    assert codes[killed] == -signal.SIGKILL, info.value  # by itself, or by the spawner once it had stopped
    assert [c for r, c in enumerate(codes) if r != killed] == [1] * (world - 1), info.value  # none killed by spawn
    assert elapsed < within_s, f"took {elapsed:.0f} s to stop"
    logs = info.value.logs.split("--- rank ")[1:]
    for rank, log in enumerate(logs):
        if rank != killed:
            assert f"rank {killed} stopped responding" in log, f"rank {rank} does not name rank {killed}:\n{log}"
    return elapsed
