"""One run per run folder: a second run on a held ``--out`` is refused in one line naming the holder; a lock left
by a killed run is taken over, said so; a run releases it at its end, at a refusal and when a signal stops it."""
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from nanotrain.run.lock import LOCK
from tests.conftest import REPO, SHAKESPEARE, TOKENIZER_DIR

RUN = ["--model", "tiny", "--batch", "4", "--seq", "32", "--steps", "1", "--data", str(SHAKESPEARE),
       "--tokenizer-dir", str(TOKENIZER_DIR), "--no-tensorboard", "--out", "run"]
HOLD = ("import sys, time; from pathlib import Path; from nanotrain.run.lock import hold\n"
        "with hold(Path('run')):\n    print('held', flush=True); time.sleep(120)")


@pytest.fixture
def holder(offline_files, tmp_path, monkeypatch):
    """Another process holding ``tmp_path/run`` as a run would."""
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, "--steps", "9"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline() == "held\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_second_run_on_a_held_folder_is_refused_naming_the_holder(holder, tmp_path, capsys):
    from tasks.finetune import main

    with pytest.raises(SystemExit) as e:
        main(RUN)
    assert e.value.code == 2
    err = capsys.readouterr().err
    pattern = (rf"error: run is in use by another run: pid {holder.pid} on {re.escape(socket.gethostname())} "
               rf"\(-c --steps 9\), since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d.*; wait for it to end, pass another --out, "
               rf"or, if that run is gone, delete run/{LOCK}\n")
    assert re.fullmatch(pattern, err), err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOCK]  # the holder's folder untouched


def test_a_lock_left_by_a_killed_run_is_taken_over_and_released_at_the_end(holder, tmp_path, capsys):
    from tasks.finetune import main

    holder.send_signal(signal.SIGKILL)  # no code of the holder runs: its lock stays
    holder.wait()
    assert (tmp_path / "run" / LOCK).is_file()
    main(RUN)
    out = capsys.readouterr().out
    assert f"taking over run/{LOCK} from a run that is gone: pid {holder.pid} on " in out, out
    assert (tmp_path / "run" / "latest").is_file() and not (tmp_path / "run" / LOCK).exists()


def test_a_refused_run_releases_the_folder_and_leaves_none(offline_files, tmp_path, monkeypatch, capsys):
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SystemExit, match="the corpus has 1 tokens"):  # refused while holding the folder
        main(RUN + ["--data", "empty.txt"])
    assert not (tmp_path / "run").exists()
    main(RUN)  # the folder is free again
    assert not (tmp_path / "run" / LOCK).exists()
