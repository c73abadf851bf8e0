"""The user-facing entry points, end to end on the CPU with the tiny preset."""
import json

import pytest

from nanotrain.core.models import preset
from tests.conftest import SHAKESPEARE, TOKENIZER_DIR
from tests.task_losses import assert_first_losses



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
    assert (tmp_path / "run" / "step-000003" / "shard-00000-of-00001.safetensors").is_file()  # the one format
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
    # random weights are made as they load: no file is written
    assert out.startswith("--- sample 0 ---\nHello") and not (tmp_path / ".cache" / "random-weights").exists()


def test_compare_adam_bits_runs_both_through_the_run_path(offline_files, tmp_path, monkeypatch):
    """Both runs are tasks.finetune's, each in its run folder: the same weights and batch give the same first loss
    (the moments' storage acts only from the first update on)."""
    from tasks.compare_adam_bits import main

    monkeypatch.chdir(tmp_path)
    main(["--steps", "2", "--batch", "2", "--seq", "16", "--device", "cpu", "--data", str(SHAKESPEARE),
          "--tokenizer-dir", str(TOKENIZER_DIR), "--out", "bits"])
    curves = json.loads((tmp_path / "bits" / "adam_bits.json").read_text())["curves"]
    a, b = curves["32-bit moments"], curves["8-bit moments"]
    assert len(a) == len(b) == 2 and a[0] == b[0], curves
    assert (tmp_path / "bits" / "8-bit" / "metrics.jsonl").is_file() and (tmp_path / "bits" / "adam_bits.png").is_file()


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


# The CIFAR MLP's loss, its reductions: the first linear's 3072 inputs, batch norm's mean and variance over the
# batch of 16, the second linear's 512 (its tensor-parallel halves' sum), layer norm's 256 twice, the head's 256,
# the log-sum-exp over 10 classes, the mean over 16
MLP_LOSS = [3 * 32 * 32, 16, 16, 512, 256, 256, 256, 10, 16]


def test_pipeline_task_trains_through_the_run_path_as_one_process(tmp_path, monkeypatch):
    """``tasks.pipeline`` runs tasks.finetune --pp 2 and the single process into their run folders, the curves
    read back and overlaid (bytes tokenizer: needs no files)."""
    from tasks.pipeline import main

    monkeypatch.chdir(tmp_path)
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    main(["--stages", "2", "--schedule", "1f1b", "--steps", "3", "--tokenizer", "bytes", "--data", str(text),
          "--n-layer", "4", "--seq", "16", "--microbatches", "2", "--out", "out"])
    runs = json.loads((tmp_path / "out" / "gpt2_loss.json").read_text())["runs"]
    ours, ref = runs["1f1b"]["loss"], runs["single process"]["loss"]
    assert len(ours) == len(ref) == 3
    # the first, at the same weights; the later ones unbounded: the demo's runs save no weights (demos.loop.run_path)
    assert_first_losses(ours[:1], ref[:1], preset("tiny", n_layer=4), 16, 2 * 16)
    assert (tmp_path / "out" / "1f1b" / "metrics.jsonl").is_file() and (tmp_path / "out" / "gpt2_loss.png").is_file()


def test_tensor_parallel_task_trains_a_cifar_mlp_as_one_process(tmp_path, monkeypatch):
    """The CIFAR models' loop (``tasks.demos.loop``): the MLP on 2 tensor-parallel ranks beside one process,
    validated on the test split (the synthetic stand-in without torchvision)."""
    from tasks.tensor_parallel import main

    monkeypatch.chdir(tmp_path)
    main(["--model", "mlp", "--tp", "2", "--steps", "2", "--batch", "16", "--eval-batches", "1", "--out", "mlp.png"])
    runs = json.loads((tmp_path / "mlp.json").read_text())["runs"]
    ours, ref = runs["tensor parallel"], runs["single process"]
    assert len(ours["loss"]) == len(ref["loss"]) == 2 and len(ours["val_loss"]) == len(ref["val_loss"])
    # the first, at the same weights; the later and the validation losses, after updates, unbounded: the CIFAR loop
    # saves no weights (a vision model, outside the run path)
    assert_first_losses(ours["loss"][:1], ref["loss"][:1], MLP_LOSS)


@pytest.mark.parametrize("task,flags,error", [
    ("pipeline", ["--balance", "measured"], "--balance shape only each stage's speed"),
    ("tensor_parallel", ["--compile"], "--compile is not built for tasks.finetune --tp"),
    ("tensor_parallel", ["--model", "mlp", "--sp"], "--sp and --tp-overlap apply to language models only"),
])
def test_the_demos_refuse_what_they_no_longer_do_in_one_line(task, flags, error, capsys):
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"tasks.{task}").main(flags)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and error in err.splitlines()[-1], err  # argparse's usage, then the one line
