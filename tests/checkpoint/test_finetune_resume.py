"""tasks.finetune --resume checks what it resumes: the model, the run's settings, nothing left to do;
metrics cut back; a checkpoint holding NaN is warned about and stops the run after N skipped steps."""
import json

import pytest

from tests.conftest import SHAKESPEARE, TOKENIZER_DIR


@pytest.fixture
def run(offline_files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from tasks.finetune import main

    main(["--model", "tiny", "--batch", "4", "--micro-batch", "2", "--seq", "32", "--data", str(SHAKESPEARE),
          "--tokenizer-dir", str(TOKENIZER_DIR), "--out", "run", "--lr", "1e-3", "--steps", "3", "--save-every", "1",
          "--keep-last", "2"])
    return tmp_path / "run"


def snapshot(folder):
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*")}


def test_resume_checks_the_model_and_the_settings_before_building_anything(run, capsys):
    from tasks.finetune import main

    capsys.readouterr()
    assert sorted(p.name for p in run.glob("step-*")) == ["step-000002", "step-000003"]  # --keep-last 2
    before = snapshot(run)
    with pytest.raises(SystemExit, match=r"saved with --model tiny and cannot be resumed with --model gpt2; leave "
                                         r"--model out") as e:
        main(["--out", "run", "--resume", "--model", "gpt2", "--steps", "5"])
    assert e.value.code == 2
    with pytest.raises(SystemExit, match=r"saved with --adam-bits 32 and cannot be resumed with --adam-bits 8"):
        main(["--out", "run", "--resume", "--adam-bits", "8", "--steps", "5"])
    with pytest.raises(SystemExit, match=r"resuming with --seq 16 \(the checkpoint's run had 32\); --lr 0.01 "
                                         r"\(the checkpoint's run had 0.001\) would not continue the run exactly; "
                                         r"leave those out to take the checkpoint's, or pass --allow-changes"):
        main(["--out", "run", "--resume", "--lr", "0.01", "--seq", "16", "--steps", "5"])
    with pytest.raises(SystemExit, match=r"run holds a run's checkpoints; pass --resume to continue it"):
        main(["--out", "run", "--model", "tiny", "--seq", "32"])
    main(["--out", "run", "--resume"])  # at its last step: nothing to do, nothing written
    assert "nothing to do: run/step-000003 is at step 3 and --steps 3 is the run's total" in capsys.readouterr().out
    assert snapshot(run) == before


def test_resume_takes_the_saved_settings_and_cuts_the_metrics_back(run, capsys):
    from tasks.finetune import main

    (run / "latest").write_text("step-000002\n")  # as if the run had been killed after step 3's metrics
    capsys.readouterr()
    main(["--out", "run", "--resume", "--steps", "4", "--micro-batch", "1", "--allow-changes", "--lr", "2e-3"])
    out = capsys.readouterr().out
    assert "warning: resuming with --micro-batch 1 (the checkpoint's run had 2)" in out
    assert "warning: resuming with --lr 0.002 (the checkpoint's run had 0.001)" in out
    assert "dropped 1 records past step 2 from run/metrics.jsonl" in out
    assert "batch 4 x 32 as 4 micro-batches of 1" in out  # --batch and --seq from the checkpoint, not the defaults
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    saved = json.loads((run / "step-000004" / "trainer.json").read_text())["meta"]
    assert (saved["lr"], saved["seq"], saved["weight_decay"], saved["keep_last"]) == (2e-3, 32, 0.0, 2)


def test_a_checkpoint_holding_nan_is_named_and_stops_after_n_skipped_steps(run, capsys):
    from safetensors.torch import load_file, save_file

    from nanotrain.checkpoint.checksums import write_sums
    from tasks.finetune import main

    path = run / "step-000003" / "shard-00000-of-00001.safetensors"  # one process: one shard of whole leaves
    sd = load_file(path)
    sd["master.blocks.1.fc_w"][0, 0] = float("nan")
    save_file(sd, path)
    write_sums(path.parent)  # as the run would have listed it had it saved the NaN itself (else: corrupt)
    capsys.readouterr()
    with pytest.raises(SystemExit, match=r"error: 2 steps in a row \(4..5\) had a non-finite loss") as e:
        main(["--out", "run", "--resume", "--steps", "9", "--max-skipped-steps", "2"])
    assert e.value.code == str(e.value)  # a message, not 2: exit status 1 (the input was fine, the run failed)
    out = capsys.readouterr().out
    assert "warning: run/step-000003 holds inf/NaN in 1 tensors (blocks.1.fc_w)" in out
    assert (run / "latest").read_text() == "step-000003\n"  # nothing saved from the failing steps


def test_kill_9_while_saving_every_step_then_resume(offline_files, tmp_path):
    """Real kills of a run saving every step: each resume finds a complete checkpoint, the metrics hold each
    step once, and the temporaries of the killed saves are gone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    cmd = [sys.executable, "-m", "tasks.finetune", "--model", "tiny", "--batch", "2", "--seq", "16", "--data",
           str(SHAKESPEARE), "--tokenizer-dir", str(TOKENIZER_DIR), "--out", "run", "--steps", "100000",
           "--save-every", "1", "--keep-last", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for attempt, delay in enumerate((0.35, 0.6)):
        proc = subprocess.Popen(cmd + (["--resume"] if attempt else []), cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while not (tmp_path / "run" / "metrics.jsonl").exists() or len(
                (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) < 3 * (attempt + 1):
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.05)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    from nanotrain.checkpoint.run_dir import find_checkpoint
    run = tmp_path / "run"
    step = int(find_checkpoint(run)[0].name.removeprefix("step-"))
    r = subprocess.run(cmd[:-6] + ["--steps", str(step + 1), "--resume"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and f"resumed from run/step-{step:06d} at step {step}" in r.stdout, r.stderr
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, step + 2))


def test_a_new_run_and_generation_start_from_a_checkpoint_s_masters_with_weights(run, capsys):
    """``--weights OUT/step-N``: a checkpoint holds no model file, and its fp32 masters are what a run starts
    from (at lr 0 a step leaves them as they are, bit for bit) and what ``tasks.generate`` samples from (the
    greedy tokens of its export)."""
    import torch

    from nanotrain.checkpoint.resume import load_masters
    from tasks.consolidate import main as consolidate
    from tasks.finetune import main
    from tasks.generate import main as generate

    greedy = ["--model", "tiny", "--tokenizer-dir", str(TOKENIZER_DIR), "--prompt", "To be", "--temperature", "0",
              "--max-new-tokens", "8", "--device", "cpu"]
    consolidate(["run/step-000003", "--out", "hf"])
    capsys.readouterr()
    generate(greedy + ["--weights", "hf"])
    exported = capsys.readouterr().out
    generate(greedy + ["--weights", "run/step-000003"])
    assert capsys.readouterr().out == exported

    main(["--model", "tiny", "--batch", "4", "--micro-batch", "2", "--seq", "32", "--data", str(SHAKESPEARE),
          "--tokenizer-dir", str(TOKENIZER_DIR), "--out", "again", "--lr", "0", "--weight-decay", "0", "--steps", "1",
          "--weights", "run/step-000003"])
    saved, again = load_masters(run / "step-000003"), load_masters(run.parent / "again" / "step-000001")
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)
