"""--resume restores every setting of the saved run before any is checked (the data-parallel ones included),
refuses what would break exactness in one line before any process starts, and follows a changed lr schedule
as its warning says (an extended decay says how to decay over the longer run)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import SHAKESPEARE, TOKENIZER_DIR

TINY = ["--model", "tiny", "--seq", "32", "--data", str(SHAKESPEARE), "--tokenizer-dir", str(TOKENIZER_DIR),
        "--no-tensorboard"]


def rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_dp_resume_takes_the_run_s_settings_before_checking_them(offline_files, tmp_path, monkeypatch, capfd):
    from nanotrain.data_parallel import launch
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    main(TINY + ["--batch", "12", "--lr", "1e-3", "--steps", "1", "--out", "run", "--dp", "3", "--zero", "2",
                 "--sharded-save"])
    capfd.readouterr()
    # The command, as each torchrun rank runs it: --batch 64 (the default) no longer checked against --dp 3.
    with monkeypatch.context() as m:
        m.setenv("RANK", "0")
        m.setenv("WORLD_SIZE", "3")
        main(["--dp", "3", "--resume", "--steps", "1", "--out", "run"])
    assert "nothing to do: run/step-000001 is at step 1" in capfd.readouterr().out
    # A world size the run's batch cannot split over: refused in one line, before any process starts.
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("processes started"))
    with pytest.raises(SystemExit) as e:
        main(["--dp", "8", "--resume", "--steps", "2", "--out", "run"])
    assert str(e.value) == ("error: the run's --batch 12 does not split over --dp 8 ranks; resume with --dp 1, 2, 3, "
                            "4, 6 or 12 (a --batch of its own would make the run differ from the saved one: "
                            "--allow-changes)")
    with pytest.raises(SystemExit, match=r"in micro-batches of 4; resume with --dp 1 or 3, or --micro-batch 1, 2, 3 "
                                         r"or 6 at --dp 2"):
        main(["--dp", "2", "--micro-batch", "4", "--resume", "--steps", "2", "--out", "run"])
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    # --zero 2 comes back with the rest: the resumed run (at --dp 2) saves its shards, as every run does.
    main(["--dp", "2", "--resume", "--steps", "2", "--out", "run"])
    out = capfd.readouterr().out
    assert "warning: resuming with --dp 2 (the checkpoint's run had 3)" in out
    assert "over 2 data-parallel ranks (6 sequences each, ZeRO-2)" in out
    assert (tmp_path / "run" / "step-000002" / "shard-00001-of-00002.safetensors").is_file()


def test_a_changed_lr_is_the_lr_the_resumed_run_trains_at(offline_files, tmp_path, monkeypatch, capsys):
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    main(TINY + ["--batch", "4", "--lr", "1e-3", "--steps", "2", "--out", "run"])
    capsys.readouterr()
    main(["--out", "run", "--resume", "--steps", "3", "--lr", "3e-4", "--allow-changes"])
    out = capsys.readouterr().out
    assert "warning: resuming with --lr 0.0003 (the checkpoint's run had 0.001)" in out
    assert "lr schedule from step 2: lr 0.0003 (the run's was lr 0.001)" in out and "command line" not in out
    main(["--out", "run", "--resume", "--steps", "4"])  # the same settings again: nothing said about the lr
    assert "lr schedule" not in capsys.readouterr().out
    assert [r["lr"] for r in rows(tmp_path / "run")] == [1e-3, 1e-3, 3e-4, 3e-4]


def test_extending_a_finished_decay_says_how_to_decay_again(offline_files, tmp_path, monkeypatch, capsys):
    from nanotrain.core.train.schedule import LRSchedule
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    main(TINY + ["--batch", "4", "--lr", "1e-3", "--lr-schedule", "cosine", "--steps", "3", "--out", "run"])
    capsys.readouterr()
    main(["--out", "run", "--resume", "--steps", "4"])
    stretched = LRSchedule(1e-3, "cosine", 0, 5, 1e-4)
    assert ("note: the run's cosine decay ends at step 3, so step 4 trains at its floor, lr 0.0001; to decay over "
            "the longer run instead, add --decay-steps 4 --allow-changes") in capsys.readouterr().out
    assert rows(tmp_path / "run")[-1]["lr"] == 1e-4  # the floor, lr / 10: exact in float64, as the metrics keep it
    main(["--out", "run", "--resume", "--steps", "5", "--decay-steps", "5", "--allow-changes"])
    assert rows(tmp_path / "run")[-1]["lr"] == stretched.lr_at(4)  # decaying again: the same schedule's float64 rate
