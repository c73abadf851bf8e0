"""``--pack``/``--no-pack``: instruction data packed by default, padded with ``--no-pack``, a text corpus's documents
packed with ``--pack``; a resume keeps the saved choice, and a checkpoint from before packing existed resumes
padded (the batches it was trained on)."""
import json

import pytest

from nanotrain.run.folder import restore_settings
from tests.conftest import SHAKESPEARE, TOKENIZER_DIR


def test_a_resume_keeps_the_packing_and_an_older_checkpoint_resumes_padded():
    args = {"pack": None, "batch": 8}
    restore_settings(args, set(), {"batch": 8}, allow_changes=False)  # saved before --pack existed
    assert args["pack"] is False
    args = {"pack": None, "batch": 8}
    restore_settings(args, set(), {"batch": 8, "pack": None}, allow_changes=False)
    assert args["pack"] is None
    with pytest.raises(ValueError, match="--no-pack|--pack"):
        restore_settings({"pack": False, "batch": 8}, {"pack"}, {"batch": 8, "pack": None}, allow_changes=False)


def test_finetune_packs_chat_data_unless_told_not_to(offline_files, tmp_path, monkeypatch, capsys):
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": f"what is {i} plus {i}?", "response": f"it is {2 * i}"}) + "\n"
                            for i in range(40)))
    common = ["--model", "tiny", "--batch", "4", "--micro-batch", "2", "--seq", "64", "--steps", "2", "--no-save",
              "--tokenizer-dir", str(TOKENIZER_DIR), "--lr", "1e-3"]
    main(common + ["--data", str(chat), "--out", "packed", "--val-fraction", "0.5", "--eval-every", "1"])
    main(common + ["--data", str(chat), "--out", "padded", "--no-pack"])
    main(common + ["--data", str(SHAKESPEARE), "--out", "text", "--pack"])
    out = capsys.readouterr().out
    assert "packed into" in out and "padded to --seq 64" in out and out.count("packed into") == 2
    rows = [json.loads(line) for line in (tmp_path / "packed" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["trained_tokens"] > 0 and rows[0]["trained_tokens_per_s"] > 0 and "val_loss" in rows[0]
