"""``tasks.finetune --tp --pp`` end to end on the CPU (gloo): the 3D trainer through the one run.

tp 2 x pp 2 (4 processes, sequence parallelism) trains the single process's losses and validation losses
(``task_losses.assert_task_losses``: fp32, only the sums' order differs) under a warm-up and cosine lr
schedule; saved at step 2 and resumed, it makes bitwise the losses of the run that was not interrupted (the
layout, the data position and the schedule come back with the checkpoint, in the one format), and
its export loads; a one-process checkpoint resumes at tp 2. A ZeRO-2 run with 8-bit moments (its replicas checked
equal, every rank profiled) resumes at another dp; a run starts from a Hugging Face folder's weights as one process
does (with the TP collectives overlapped and blocks recomputed; and at pp 3, whose middle stage holds no tied leaf)
and saves at its end. What cannot apply is refused in one line before any process starts.
"""
from __future__ import annotations

import json

import pytest

from nanotrain.core.models import preset
from nanotrain.core.optim import AdamConfig
from tests.conftest import SHAKESPEARE, TOKENIZER_DIR, assert_export_and_cap
from tests.task_losses import assert_first_losses, assert_task_losses

TINY = ["--model", "tiny", "--batch", "8", "--seq", "32", "--data", str(SHAKESPEARE), "--tokenizer-dir",
        str(TOKENIZER_DIR), "--lr", "1e-3", "--no-tensorboard"]
SEQ, TOKENS = 32, 8 * 32  # a row, a batch's targets: the loss's chain (conftest.model_chain)


def rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run, key: str = "loss") -> list[float]:
    return [r[key] for r in rows(run) if key in r]


def test_tp2_pp2_trains_one_process_s_losses_saves_and_resumes(offline_files, tmp_path, monkeypatch):
    import shutil

    from tasks.consolidate import main as consolidate
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    common = TINY + ["--lr-schedule", "cosine", "--warmup-steps", "2", "--decay-steps", "4", "--val-fraction", "0.05",
                     "--eval-every", "2", "--eval-batches", "1"]
    saved = ["--save-every", "1", "--keep-last", "0"]  # every step's weights, which bound the next losses
    main(common + saved + ["--steps", "4", "--out", "one"])
    main(common + ["--steps", "4", "--out", "straight", "--tp", "2", "--pp", "2", "--sp"])
    main(common + saved + ["--steps", "2", "--out", "3d", "--tp", "2", "--pp", "2", "--sp"])
    main(["--steps", "4", "--out", "3d", "--resume"])  # the layout, the schedule and the data position come back
    one, straight, ours = rows(tmp_path / "one"), rows(tmp_path / "straight"), rows(tmp_path / "3d")
    for key in ("loss", "lr", "val_loss"):
        assert [r.get(key) for r in ours] == [r.get(key) for r in straight], key  # bitwise
    assert [r["lr"] for r in ours] == [r["lr"] for r in one]  # the schedule's, of the step alone
    cfg = preset("tiny")
    assert_task_losses(tmp_path / "3d", tmp_path / "one", cfg, SEQ, TOKENS)
    assert_task_losses(tmp_path / "3d", tmp_path / "one", cfg, SEQ, TOKENS, "val_loss")
    manifest = json.loads((tmp_path / "3d" / "step-000004" / "manifest.json").read_text())
    assert manifest["layout"] == {"tp": 2, "pp": 2, "dp": 1, "zero": 0}
    consolidate(["3d/step-000004", "--out", "hf", "--dtype", "fp32"])  # the masters themselves
    # the export its checkpoint's masters bit for bit; those within 4 AdamW steps' reach (at the peak lr) of one's
    assert_export_and_cap(tmp_path / "hf", tmp_path / "3d/step-000004", tmp_path / "one/step-000004", cfg, 4,
                          AdamConfig(lr=1e-3))
    shutil.copytree(tmp_path / "one", tmp_path / "one at tp 2")  # one process's checkpoint, resumed at tp 2
    main(["--steps", "5", "--out", "one at tp 2", "--resume", "--tp", "2"])
    main(["--steps", "5", "--out", "one", "--resume"])
    # the first step after the resume, each from the checkpoint's weights: within the loss chain's bound
    assert_first_losses(losses(tmp_path / "one at tp 2")[-1:], losses(tmp_path / "one")[-1:], cfg, SEQ, TOKENS)


def test_a_zero_run_with_8_bit_moments_resumes_at_another_dp(offline_files, tmp_path, monkeypatch, capsys):
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    main(TINY + ["--pp", "2", "--dp", "2", "--zero", "2", "--adam-bits", "8", "--steps", "1", "--out", "run",
                 "--dp-check", "--profile-steps", "1:1"])
    assert sorted(p.name for p in (tmp_path / "run" / "profile").glob("trace-*")) == [
        f"trace-rank{r}.json" for r in range(4)]  # a trace per rank
    main(["--dp", "1", "--zero", "0", "--steps", "2", "--resume", "--out", "run"])
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-000002"
    assert "warning: resuming with --dp 1 (the checkpoint's run had 2)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="8-bit moments quantized per leaf as held at tp 1"):
        main(["--tp", "2", "--steps", "3", "--resume", "--out", "run"])


@pytest.mark.parametrize("n_layer,layout", [
    (2, ["--pp", "2", "--tp", "2", "--tp-overlap", "--recompute", "every"]),
    (3, ["--pp", "3"]),  # a middle stage, in no tied leaf's group: the run's save at its end once hung there
])
def test_a_3d_run_starts_from_a_hugging_face_folder_as_one_process_does(n_layer, layout, offline_files, tmp_path,
                                                                        monkeypatch):
    from nanotrain.core.models import init_params, preset
    from tasks.finetune import main
    from weights import save_hf

    monkeypatch.chdir(tmp_path)
    cfg = preset("tiny", n_layer=n_layer)
    save_hf(init_params(cfg, seed=7), cfg, tmp_path / "hf")
    start = TINY[2:] + ["--model", "hf", "--weights", "hf", "--steps", "1"]
    main(start + ["--out", "one"])
    main(start + ["--out", "3d", *layout])
    assert_task_losses(tmp_path / "3d", tmp_path / "one", cfg, SEQ, TOKENS)  # one step, from the folder's weights
    assert (tmp_path / "3d" / "latest").read_text().strip() == "step-000001"  # saved at its end, whole


@pytest.mark.parametrize("flags,error", [
    (["--tp", "2", "--stream"], "--stream does not combine with --tp/--pp (each stage's weights stay on its GPUs)"),
    (["--model", "tiny-llama", "--tp", "4", "--dp", "2", "--zero", "1", "--clip-norm", "1"],
     "--clip-norm or --dtype fp16 with --zero 1 counts each key/value head's gradient once"),
    (["--pp", "2", "--recompute", "lean"], "--recompute lean does not combine with --tp/--pp (whole blocks or nothing"),
    (["--tp", "2", "--dp", "2", "--zero", "3", "--recompute", "every"], "--zero 3 does not combine with --tp/--pp"),
    (["--tp", "2", "--pp", "2", "--dp", "2", "--schedule", "interleaved-1f1b"],
     "tiny has 2 layers to split but --pp 2 with interleaved-1f1b makes 4 stages; pass --n-layer 4"),
    (["--pp", "2", "--schedule", "zb-h1", "--tp", "2", "--tp-overlap"], "--tp-overlap computes weight gradients"),
    (["--tp", "5"], "--tp 5: tp=5 neither splits the model's 4 key/value heads"),
    (["--sp"], "--sp shapes a tensor- or pipeline-parallel layout; add --tp or --pp above 1, or leave it out"),
    (["--model", "gpt2", "--weights", "hub", "--n-layer", "4"],
     "--n-layer 4 makes a preset of another depth, with random weights"),
])
def test_what_cannot_apply_is_refused_in_one_line_before_any_process_starts(flags, error, tmp_path, monkeypatch,
                                                                             capsys):
    from nanotrain.data_parallel import launch
    from tasks.finetune import main

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("processes started"))
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", "--batch", "8", "--seq", "32", "--out", str(tmp_path / "run"), *flags])
    assert e.value.code == 2 and error in str(e.value), str(e.value)
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_under_torchrun_the_layout_must_be_the_world(tmp_path, monkeypatch):
    from tasks.finetune import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit, match=r"--tp 2 x --pp 2 x --dp 1 = 4 ranks, but torchrun started 3 processes"):
        main(["--model", "tiny", "--batch", "8", "--seq", "32", "--out", str(tmp_path / "run"), "--tp", "2", "--pp",
              "2"])


def test_tp_trains_a_folder_with_dropout_as_one_process_does(offline_files, tmp_path, monkeypatch):
    """Every GPT-2 folder transformers writes has dropout 0.1: --tp 2 --dp 2 draws the single process's masks (each
    replica's micro-batches are the one process's, in batch order), so its losses are one process's at the same
    micro-batch (``task_losses.assert_first_losses``); at another micro-batch the masks, and the losses, differ."""
    from tasks.finetune import main
    from tests.core.test_model_folders import hf_folder
    from weights.resolve import read_config

    monkeypatch.chdir(tmp_path)
    folder = hf_folder(tmp_path / "m")
    run = ["--model", str(folder), "--batch", "8", "--seq", "32", "--steps", "2", "--data", str(SHAKESPEARE),
           "--lr", "1e-3", "--no-tensorboard", "--no-save"]
    main(run + ["--micro-batch", "4", "--out", "one"])
    main(run + ["--micro-batch", "8", "--out", "whole"])
    main(run + ["--tp", "2", "--dp", "2", "--out", "tp"])
    ours, one, whole = ([r["loss"] for r in rows(tmp_path / name)] for name in ("tp", "one", "whole"))
    cfg = read_config(folder)
    assert len(ours) == len(one) == 2
    # the first, at the same weights; the second unbounded: no weights saved (--no-save), and its gradient is under
    # masks a test's one process does not redraw
    assert_first_losses(ours[:1], one[:1], cfg, SEQ, TOKENS)
    with pytest.raises(AssertionError):  # the masks follow the micro-batches: dropout is on
        assert_first_losses(whole[:1], one[:1], cfg, SEQ, TOKENS)


def test_a_pipeline_with_dropout_is_refused_naming_the_keys_that_turn_it_off(tmp_path, monkeypatch, capsys):
    """Refused before any process starts, naming the config.json keys; with them at 0 the run starts."""
    from nanotrain.data_parallel import launch
    from tasks.finetune import main
    from tests.core.test_model_folders import hf_folder

    folder = hf_folder(tmp_path / "m")
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("processes started"))
    argv = ["--model", str(folder), "--batch", "8", "--seq", "32", "--out", str(tmp_path / "run"), "--pp", "2"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    assert str(e.value) == (f"error: {folder} has dropout (embed 0.1, attention 0.1, residual 0.1), which "
                            f"--pp 2 does not train as one process would; set embd_pdrop, attn_pdrop, resid_pdrop to 0 "
                            f"in {folder}/config.json, or train without --pp (--tp alone trains dropout exactly)"), e
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "embd_pdrop": 0, "attn_pdrop": 0, "resid_pdrop": 0}))

    class Started(Exception):
        pass

    def start(*_, **__):
        raise Started

    monkeypatch.setattr(launch, "spawn", start)
    with pytest.raises(Started):  # every check passed: the ranks would start now
        main(argv)
