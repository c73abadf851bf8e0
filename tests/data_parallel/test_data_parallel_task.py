"""``tasks.finetune --dp N --zero K`` end to end on the CPU: the single-process losses, a resume at
another world size and ZeRO stage, or as one process, continues them (``--sharded-save`` is kept and does
nothing: every checkpoint is sharded), and ``tasks.consolidate`` exports a checkpoint's model."""
import pytest
from nanotrain.core.models import preset
from nanotrain.core.optim import AdamConfig
import torch

from tests.conftest import SHAKESPEARE, TOKENIZER_DIR, assert_export_and_cap
from tests.task_losses import assert_first_losses, assert_task_losses, metrics

TINY = preset("tiny")
SAVED = ["--save-every", "1", "--keep-last", "0"]  # every step's weights, which bound the next losses (task_losses)


def losses(run) -> list[float]:
    return list(metrics(run).values())


def test_finetune_data_parallel_matches_one_process_and_resumes_at_another_size(offline_files, tmp_path,
                                                                                 monkeypatch):
    """The single-process losses and validation losses: 2 steps at --dp 3 --zero 1, resumed at --dp 2 --zero 3
    (whose validation gathers unit by unit)."""
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    common = ["--model", "tiny", "--batch", "12", "--micro-batch", "2", "--seq", "32", "--recompute", "every",
              "--data", str(SHAKESPEARE), "--tokenizer-dir", str(TOKENIZER_DIR), "--lr", "1e-3",
              "--val-fraction", "0.05", "--eval-every", "2", "--eval-batches", "1"] + SAVED
    main(common + ["--steps", "3", "--out", "one"])
    main(common + ["--steps", "2", "--out", "dp", "--dp", "3", "--zero", "1"])
    assert (tmp_path / "dp" / "latest").read_text().strip() == "step-000002"
    main(common + ["--steps", "3", "--out", "dp", "--dp", "2", "--zero", "3", "--resume"])
    assert len(losses(tmp_path / "dp")) == 3 and len(metrics(tmp_path / "one", "val_loss")) == 2
    assert_task_losses(tmp_path / "dp", tmp_path / "one", TINY, 32, 12 * 32)
    assert_task_losses(tmp_path / "dp", tmp_path / "one", TINY, 32, 12 * 32, "val_loss")
    assert (tmp_path / "dp" / "step-000003" / "manifest.json").is_file()
    with pytest.raises(SystemExit, match=r"batch 12 does not split over 3 data-parallel ranks in micro-batches of 3"):
        main(common[:4] + ["--micro-batch", "3", "--out", "bad", "--dp", "3"])


def test_finetune_sharded_save_resumes_at_another_size_and_consolidates(offline_files, tmp_path, monkeypatch):
    import shutil

    from tasks.consolidate import main as consolidate
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    common = ["--model", "tiny", "--batch", "12", "--micro-batch", "2", "--seq", "32", "--recompute", "every",
              "--data", str(SHAKESPEARE), "--tokenizer-dir", str(TOKENIZER_DIR), "--lr", "1e-3"] + SAVED
    main(common + ["--steps", "3", "--out", "one"])
    main(common + ["--steps", "2", "--out", "dp", "--dp", "3", "--zero", "3", "--sharded-save"])
    assert (tmp_path / "dp" / "step-000002" / "shard-00002-of-00003.safetensors").is_file()
    shutil.copytree(tmp_path / "dp", tmp_path / "alone")
    main(common + ["--steps", "3", "--out", "dp", "--dp", "2", "--zero", "1", "--sharded-save", "--resume"])
    main(["--steps", "3", "--out", "alone", "--dp", "1", "--zero", "0", "--resume"])  # issue 39: was refused
    for run in ("dp", "alone"):
        assert_task_losses(tmp_path / run, tmp_path / "one", TINY, 32, 12 * 32)
    consolidate(["dp/step-000003", "--out", "hf", "--dtype", "fp32"])  # the masters themselves
    # the export its checkpoint's masters bit for bit; those within 3 AdamW steps' reach of one process's
    assert_export_and_cap(tmp_path / "hf", tmp_path / "dp/step-000003", tmp_path / "one/step-000003", TINY, 3,
                          AdamConfig(lr=1e-3))


def test_finetune_streamed_data_parallel_matches_one_process_and_resumes_at_another_size(offline_files, tmp_path,
                                                                                          monkeypatch):
    """``--stream --dp N`` (ZeRO-Offload): the single-process streamed losses and validation losses, sharded
    saves at 3 ranks resumed at 2."""
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    common = ["--model", "tiny", "--batch", "12", "--micro-batch", "2", "--seq", "32", "--stream", "--data",
              str(SHAKESPEARE), "--tokenizer-dir", str(TOKENIZER_DIR), "--lr", "1e-3", "--val-fraction", "0.05",
              "--eval-every", "2", "--eval-batches", "1"] + SAVED
    main(common + ["--steps", "3", "--out", "one"])
    main(common + ["--steps", "2", "--out", "dp", "--dp", "3", "--sharded-save", "--host-mem-gib", "8"])
    assert (tmp_path / "dp" / "step-000002" / "shard-00002-of-00003.safetensors").is_file()
    main(common + ["--steps", "3", "--out", "dp", "--dp", "2", "--sharded-save", "--resume"])
    assert len(losses(tmp_path / "dp")) == 3 and len(metrics(tmp_path / "one", "val_loss")) == 2
    assert_task_losses(tmp_path / "dp", tmp_path / "one", TINY, 32, 12 * 32)
    assert_task_losses(tmp_path / "dp", tmp_path / "one", TINY, 32, 12 * 32, "val_loss")
    with pytest.raises(SystemExit, match=r"--stream with --dp shards the masters and moments .* leave out --zero 3"):
        main(common + ["--out", "bad", "--dp", "2", "--zero", "3"])


def test_finetune_streamed_data_parallel_8bit_resumes_at_any_size(offline_files, tmp_path, monkeypatch):
    """8-bit moments are saved per piece, each quantized in the blocks one process uses: a resume at the same
    --dp continues the uninterrupted losses exactly, one at another --dp within the sums' rounding; the
    masters export."""
    import shutil

    from tasks.consolidate import main as consolidate
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    common = ["--model", "tiny", "--batch", "12", "--micro-batch", "2", "--seq", "32", "--stream", "--data",
              str(SHAKESPEARE), "--tokenizer-dir", str(TOKENIZER_DIR), "--lr", "1e-3", "--adam-bits", "8",
              "--sharded-save"]
    main(common + ["--steps", "3", "--out", "whole", "--dp", "2"])
    main(common + ["--steps", "2", "--out", "dp", "--dp", "2"])
    shutil.copytree(tmp_path / "dp" / "step-000002", tmp_path / "other" / "step-000002")
    (tmp_path / "other" / "latest").write_text("step-000002\n")
    main(common + ["--steps", "3", "--out", "dp", "--dp", "2", "--resume"])
    assert losses(tmp_path / "dp") == losses(tmp_path / "whole")
    main(common + ["--steps", "3", "--out", "other", "--dp", "3", "--resume"])
    (again,), whole = losses(tmp_path / "other"), losses(tmp_path / "whole")
    assert_first_losses([again], whole[2:], TINY, 32, 12 * 32)  # from the same checkpoint's state
    consolidate(["dp/step-000003", "--out", "hf"])
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_zero_3_chooses_recompute_every_itself_and_says_so(tmp_path, monkeypatch):
    """``--zero 3`` without ``--recompute`` and without a GPU recomputes every unit (its least memory), said in the
    run's plan line and kept in its config.toml; every check passes before the ranks would start."""
    from types import SimpleNamespace

    from nanotrain.core.train.schedule import LRSchedule
    from nanotrain.data_parallel import launch
    from nanotrain.run.finetune import describe, main
    from nanotrain.run.flags import parse_args

    argv = ["--model", "tiny", "--batch", "8", "--seq", "32", "--dp", "2", "--zero", "3", "--out", str(tmp_path / "r")]
    args = parse_args(argv)
    assert args.recompute == "every" and parse_args(argv[:-6] + argv[-2:]).recompute == "none"
    built = SimpleNamespace(micro=4, dtype=torch.float32, schedule=LRSchedule(kind="constant", lr=1e-4))
    line = describe(args, preset("tiny"), built, torch.device("cpu"))
    assert "ZeRO-3), recompute every (ZeRO-3 gathers each unit's weights again for its backward)" in line, line

    class Started(Exception):
        pass

    def start(*_, **__):
        raise Started

    monkeypatch.setattr(launch, "spawn", start)
    with pytest.raises(Started):
        main(argv)


def test_hold_weights_is_zero_3s_and_a_stage_that_is_not_is_refused_naming_the_fix(tmp_path, monkeypatch, capsys):
    """``--hold-weights`` with ``--zero 3`` reaches the ranks' start; with another stage it is refused in one line
    before anything loads, naming ``--zero 3``."""
    from nanotrain.data_parallel import launch
    from nanotrain.run.finetune import main

    class Started(Exception):
        pass

    def start(*_, **__):
        raise Started

    monkeypatch.setattr(launch, "spawn", start)
    argv = ["--model", "tiny", "--batch", "8", "--seq", "32", "--dp", "2", "--hold-weights", "--out", str(tmp_path)]
    with pytest.raises(Started):
        main(argv + ["--zero", "3"])
    with pytest.raises(SystemExit):
        main(argv + ["--zero", "2"])
    assert "--hold-weights holds ZeRO-3's gathered weights; pass --dp N --zero 3" in capsys.readouterr().err
