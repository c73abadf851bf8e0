"""A save and a full disk: refused before a byte is written when the free space is short, and when a write
fails all the same (ENOSPC at each file in turn) the partial checkpoint goes at once, `latest` stays on the
previous checkpoint, which still verifies, and the error is one line. An --out that is a file or on a
read-only file system is refused in one line."""
from __future__ import annotations

import builtins
import errno
import io
import json
import os
import shutil
import threading
from collections import namedtuple

import pytest

from nanotrain.data import DataPosition
from nanotrain.checkpoint import disk
from nanotrain.checkpoint.checksums import verify
from nanotrain.checkpoint.disk import SaveFailed, check_writable
from nanotrain.checkpoint.run_dir import find_checkpoint
from nanotrain.checkpoint.state import save_checkpoint
from weights.safetensors_io import CheckpointError
from tests.conftest import SHAKESPEARE, TOKENIZER_DIR
from tests.checkpoint.test_run_dir import Toy

Usage = namedtuple("Usage", "total used free")


def full_at(monkeypatch, k: int) -> dict:
    """The k-th file the save opens for writing fails with ENOSPC, as on a disk that has just filled up (the
    digests a helper thread writes meanwhile are not counted: their failure only makes ``publish`` hash again)."""
    calls = {"n": 0}
    real = builtins.open

    def fake(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and threading.current_thread() is threading.main_thread():
            calls["n"] += 1
            if calls["n"] == k:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake)
    monkeypatch.setattr(io, "open", fake)  # pathlib's write_text
    return calls


def test_a_disk_that_fills_up_at_any_file_leaves_nothing_and_the_last_checkpoint(tmp_path, monkeypatch):
    k = 1
    while True:
        run = tmp_path / f"k{k}"
        save_checkpoint(run, Toy().at(1), DataPosition(0, 1))
        with monkeypatch.context() as m:
            calls = full_at(m, k)
            try:
                save_checkpoint(run, Toy().at(2), DataPosition(0, 2))
                failed = None
            except SaveFailed as e:
                failed = str(e)
        if failed is None:
            break
        assert "No space left on device" in failed and "\n" not in failed, failed
        assert "removed" in failed, failed
        assert sorted(p.name for p in run.iterdir()) == ["latest", "step-000001"], (k, failed)  # nothing left over
        assert find_checkpoint(run).path.name == "step-000001" and verify(run / "step-000001")
        k += 1
    assert k > 5 and calls["n"] < k  # every file a save writes was a failure point; the last save wrote them all
    assert find_checkpoint(tmp_path / f"k{k}").path.name == "step-000002"


def test_a_save_the_free_space_cannot_hold_is_refused_before_writing(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, Toy().at(1), DataPosition(0, 1))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 20_000, 20_000))
    with pytest.raises(SaveFailed, match=r"not enough disk space to save step-000002: it needs 1.\d MB and .* has "
                                         r"0.0 MB free; nothing was written"):
        save_checkpoint(tmp_path, Toy().at(2), DataPosition(0, 2))
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_an_out_that_is_a_file_or_read_only_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    with pytest.raises(CheckpointError, match=r"--out .*afile: .*afile is a file, not a folder; pass a folder"):
        check_writable(tmp_path / "afile")
    with pytest.raises(CheckpointError, match=r"is a file, not a folder"):
        check_writable(tmp_path / "afile" / "run")
    check_writable(tmp_path / "new" / "run")
    assert not (tmp_path / "new").exists()  # checked, not created

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(disk.tempfile, "TemporaryFile", read_only)
    with pytest.raises(CheckpointError, match=r"cannot write in --out .*run: a read-only file system; pass a folder "
                                              r"you can write to"):
        check_writable(tmp_path / "run")


def test_finetune_stops_in_one_line_when_a_save_cannot_fit(offline_files, tmp_path, monkeypatch, capsys):
    """The run stops (not trains on): a run that cannot save would lose every later step with the process."""
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    common = ["--model", "tiny", "--batch", "4", "--seq", "32", "--data", str(SHAKESPEARE), "--tokenizer-dir",
              str(TOKENIZER_DIR), "--lr", "1e-3", "--no-tensorboard", "--out", "run"]
    main(common + ["--steps", "1"])
    free = shutil.disk_usage(tmp_path).free
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: Usage(free, 0, 1000))
    with pytest.raises(SystemExit) as e:
        main(["--out", "run", "--resume", "--steps", "4", "--save-every", "2"])
    assert str(e.value).startswith("error: not enough disk space to save step-000002: it needs ")
    assert str(e.value).endswith("the run stops here, as a run that cannot save would lose every further step; its "
                                 "latest checkpoint, run/step-000001, is intact: free some space in run, then continue "
                                 "with --resume")
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and sorted(p.name for p in (tmp_path / "run").glob("*step*")) == ["step-000001"]
    with pytest.raises(SystemExit, match=r"--out afile: afile is a file, not a folder"):
        (tmp_path / "afile").write_text("")
        main(common[:-2] + ["--out", "afile", "--steps", "1"])
