"""The user-facing entry points, end to end on the CPU with the tiny preset."""
import json

import pytest

from tests.conftest import SHAKESPEARE, TOKENIZER_DIR



def test_finetune_runs_saves_and_resumes_where_it_stopped(offline_files, tmp_path, monkeypatch, capsys):
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)  # random weights and token caches go under ./.cache
    common = ["--model", "tiny", "--batch", "4", "--micro-batch", "2", "--seq", "32", "--checkpoint", "every",
              "--data", str(SHAKESPEARE), "--tokenizer-dir", str(TOKENIZER_DIR), "--out", "run", "--lr", "1e-3"]
    main(common + ["--steps", "2"])
    main(common + ["--steps", "3", "--resume"])
    out = capsys.readouterr().out
    assert "resumed from run/step-000002 at step 2" in out and "step     3 | loss" in out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(k in rows[0] for k in ("loss", "seq_per_s", "tokens_per_s", "peak_gpu_gib", "rss_gib"))
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-000003"
    assert (tmp_path / "run" / "step-000003" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "loss.png").is_file()


def test_finetune_streams_and_a_resident_run_resumes_it(offline_files, tmp_path, monkeypatch, capsys):
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    common = ["--model", "tiny", "--batch", "4", "--micro-batch", "2", "--seq", "32", "--data", str(SHAKESPEARE),
              "--tokenizer-dir", str(TOKENIZER_DIR), "--out", "run"]
    main(common + ["--steps", "2", "--stream", "--adam-bits", "8"])
    main(common + ["--steps", "3", "--resume", "--adam-bits", "8"])  # checkpoints are the same format
    out = capsys.readouterr().out
    assert "weights streamed block by block" in out and "waits for copies" in out
    assert "resumed from run/step-000002 at step 2" in out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "copy_wait_fraction" in rows[0] and [r["step"] for r in rows] == [1, 2, 3]
    with pytest.raises(SystemExit, match=r"tiny needs about .* GiB .* more than --host-mem-gib 0.01"):
        main(common + ["--steps", "1", "--stream", "--host-mem-gib", "0.01", "--out", "run2"])
    assert not (tmp_path / "run2").exists()  # refused on the CPU too, before anything was written


def test_finetune_refuses_bad_input_with_the_fix(offline_files, tmp_path, monkeypatch):
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    base = ["--model", "tiny", "--seq", "32", "--tokenizer-dir", str(TOKENIZER_DIR), "--out", "run"]
    with pytest.raises(SystemExit, match="data file not found: .*nope.txt"):
        main(base + ["--data", "nope.txt"])
    with pytest.raises(SystemExit, match="--micro-batch 3 does not divide --batch 10"):
        main(base + ["--data", str(SHAKESPEARE), "--batch", "10", "--micro-batch", "3"])
    with pytest.raises(SystemExit, match="nothing to resume in run"):
        main(base + ["--data", str(SHAKESPEARE), "--resume"])
    with pytest.raises(SystemExit, match="unknown model 'gpt2-lrage'"):
        main(["--model", "gpt2-lrage"])


def test_generate_from_random_weights(offline_files, tmp_path, monkeypatch, capsys):
    from tasks.generate import main

    monkeypatch.chdir(tmp_path)
    main(["--model", "tiny", "--weights", "random", "--tokenizer-dir", str(TOKENIZER_DIR), "--prompt", "Hello",
          "--max-new-tokens", "5", "--temperature", "0"])
    out = capsys.readouterr().out
    assert out.startswith("writing random tiny weights") and "--- sample 0 ---\nHello" in out


def test_pipeline_bench_runs_both_engines_on_cpu(tmp_path):
    """The pipeline benchmark end to end (gloo, 2 ranks): our schedules, torch's peers, bubbles, plots."""
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "tasks.bench.pipeline",
           "--device", "cpu", "--model", "tiny", "--n-layer", "4", "--seq", "16", "--microbatches", "4",
           "--steps", "1", "--warmup", "0", "--schedules", "1f1b,zb-h1", "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    rows = json.loads(out.read_text())["results"]
    assert [(r["engine"], r["schedule"]) for r in rows] == [
        ("nanotrain", "1f1b"), ("nanotrain", "zb-h1"),
        ("torch.pipelining", "Schedule1F1B"), ("torch.pipelining", "ScheduleInterleavedZeroBubble")]
    ours = rows[0]
    assert 0 <= ours["bubble_replayed"] < 1 and len(ours["spans_per_rank"]) == 2
    assert ours["ideal_step_ms"] > 0 and 0 <= ours["bubble_theory_measured"] < 1


def test_pipeline_task_balances_by_measurement_and_matches_one_process(tmp_path, capfd):
    """``tasks.pipeline --balance measured`` end to end: layer costs timed, stages split by them, the
    pipelined curve equal to the single process's (bytes tokenizer: needs no files)."""
    from tasks.pipeline import main

    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    main(["--stages", "2", "--schedule", "1f1b", "--steps", "3", "--tokenizer", "bytes", "--data", str(text),
          "--n-layer", "4", "--seq", "16", "--microbatches", "2", "--balance", "measured", "--out", str(tmp_path)])
    assert "measured forward+backward per micro-batch" in capfd.readouterr().out  # rank 0's process prints it
    curves = json.loads((tmp_path / "gpt2_losses.json").read_text())["curves"]
    ref, piped = curves["single process"], curves["1f1b"]
    assert len(piped) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(piped, ref)), (piped, ref)
