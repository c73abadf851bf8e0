"""``tasks.finetune --model FOLDER`` trains the folder's own weights unless told otherwise; a folder with a config.json
and no weights is refused in one line naming it and ``--weights random``; ``config.toml`` records what was used."""
import json

import pytest

from tests.conftest import SHAKESPEARE, TOKENIZER_DIR
from tests.core.test_model_folders import hf_folder, refused

RUN = ["--batch", "4", "--seq", "32", "--steps", "1", "--no-save", "--data", str(SHAKESPEARE),
       "--tokenizer-dir", str(TOKENIZER_DIR), "--no-tensorboard"]


def first_loss(out) -> float:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]


def test_a_folder_trains_its_own_weights_by_default(offline_files, tmp_path, monkeypatch, capsys):
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    folder = hf_folder(tmp_path / "m")
    main(["--model", str(folder), "--out", "own"] + RUN)
    assert f"weights: {folder}" in capsys.readouterr().out
    assert f'weights = "{folder}"' in (tmp_path / "own" / "config.toml").read_text()
    assert not (tmp_path / ".cache" / "random-weights").exists()  # nothing random was written
    main(["--model", str(folder), "--weights", str(folder), "--out", "named"] + RUN)
    main(["--model", str(folder), "--weights", "random", "--out", "random"] + RUN)
    # the same weights, batch and seed: the same computation, bit for bit; random weights give another loss
    assert first_loss(tmp_path / "own") == first_loss(tmp_path / "named") != first_loss(tmp_path / "random")
    assert 'weights = "random"' in (tmp_path / "random" / "config.toml").read_text()


def test_a_preset_keeps_random_weights_by_default(offline_files, tmp_path, monkeypatch, capsys):
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    main(["--model", "tiny", "--out", "run"] + RUN)
    assert "weights: random (seed 0)" in capsys.readouterr().out
    assert 'weights = "random"' in (tmp_path / "run" / "config.toml").read_text()


@pytest.mark.parametrize("weights, pattern", [
    ([], r"--model .*m has a config.json but no weights \(neither model.safetensors nor "
         r"model.safetensors.index.json\): pass --weights random to train it from scratch"),
    (["--weights", "nowhere.safetensors"], r"--weights nowhere.safetensors: checkpoint file not found"),
])
def test_a_folder_without_weights_is_refused_in_one_line(offline_files, tmp_path, monkeypatch, capsys, weights,
                                                         pattern):
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    folder = hf_folder(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    refused(main, ["--model", str(folder), "--out", "run"] + weights + RUN, pattern, capsys)
    assert not (tmp_path / "run").exists()
