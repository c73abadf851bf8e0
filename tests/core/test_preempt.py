"""Pre-emption: signals sent to a running CPU fine-tuning process.

SIGTERM stops it at the next step boundary with a checkpoint and the command that resumes it, and the
process ends by SIGTERM (a shell's 143; never 0, which says the run is done); a second Ctrl-C exits at
once, by SIGINT, and the last checkpoint still resumes. A run that finishes its steps exits 0.
"""
import json
import os
import signal
import subprocess
import sys
import time


from tests.conftest import REPO, SHAKESPEARE, TOKENIZER_DIR



def finetune(tmp_path, *extra):
    cmd = [sys.executable, "-m", "tasks.finetune", "--model", "tiny", "--batch", "4", "--micro-batch", "2", "--seq",
           "32", "--data", str(SHAKESPEARE), "--tokenizer-dir", str(TOKENIZER_DIR), "--out", "run", "--lr", "1e-3",
           "--no-tensorboard", *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(proc, text, timeout=60.0) -> str:
    """The output up to the first line holding ``text`` (the process keeps running)."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    proc.kill()
    raise AssertionError(f"no {text!r} in:\n{''.join(seen)}")


def test_sigterm_saves_at_the_step_boundary_and_ends_by_sigterm(offline_files, tmp_path):
    proc = finetune(tmp_path, "--steps", "100000")
    wait_for(proc, "step     3 |")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, out  # stopped early (saved), not done
    assert "SIGTERM: stopping after this step" in out and "continue with:" in out, out
    assert "--resume" in out.rsplit("continue with:", 1)[1]
    step = int((tmp_path / "run" / "latest").read_text().strip().removeprefix("step-"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert step >= 3 and [r["step"] for r in rows] == list(range(1, step + 1))
    resumed = finetune(tmp_path, "--steps", str(step + 1), "--resume")
    out, _ = resumed.communicate(timeout=60)
    assert resumed.returncode == 0 and f"resumed from run/step-{step:06d} at step {step}" in out, out


def test_a_second_ctrl_c_exits_at_once_and_the_checkpoint_survives(offline_files, tmp_path):
    # Steps long enough (~1 s) that the second signal lands inside the step the first one let finish.
    proc = finetune(tmp_path, "--steps", "100000", "--save-every", "2", "--batch", "48")
    wait_for(proc, "step     3 |")
    proc.send_signal(signal.SIGINT)
    wait_for(proc, "SIGINT: stopping after this step")  # two signals sent at once would arrive as one
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGINT, out
    assert "SIGINT again: exiting now" in out, out
    step = int((tmp_path / "run" / "latest").read_text().strip().removeprefix("step-"))
    resumed = finetune(tmp_path, "--steps", str(step + 1), "--resume", "--batch", "48")
    out, _ = resumed.communicate(timeout=60)
    assert resumed.returncode == 0 and f"at step {step}" in out, out
