"""``tasks.finetune --lora-rank``: the run trains the pairs on a frozen base, saves them in the one checkpoint format
(only the pairs, ``adapter_config.json`` beside), exports them as a PEFT adapter folder, and a resumed run continues
exactly where the uninterrupted one goes (fp32 on the CPU: the same steps in the same order, so equal to the bit)."""
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import SHAKESPEARE, TOKENIZER_DIR


def test_lora_run_saves_its_pairs_exports_a_peft_folder_and_resumes_exactly(offline_files, tmp_path, monkeypatch,
                                                                            capsys):
    from nanotrain.checkpoint.resume import load_masters
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    common = ["--model", "tiny", "--batch", "4", "--micro-batch", "2", "--seq", "32", "--data", str(SHAKESPEARE),
              "--tokenizer-dir", str(TOKENIZER_DIR), "--lr", "1e-2", "--lora-rank", "4", "--lora-targets", "qkv,down",
              "--lora-dropout", "0.1", "--no-tensorboard"]
    main(common + ["--steps", "3", "--out", "whole", "--export"])
    main(common + ["--steps", "2", "--out", "cut"])
    main(common + ["--steps", "3", "--out", "cut", "--resume", "--stream"])  # either engine resumes the other's
    out = capsys.readouterr().out
    assert "LoRA rank 4 on qkv,down (the base frozen)" in out and "resumed from cut/step-000002" in out
    saved = tmp_path / "whole" / "step-000003"
    config = json.loads((saved / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["target_modules"] == ["attn.c_attn", "mlp.c_proj"]
    assert not (saved / "model.safetensors").exists()  # the base is --weights', not the run's
    whole, cut = load_masters(saved), load_masters(tmp_path / "cut" / "step-000003")
    assert whole.keys() == cut.keys() and all(torch.equal(whole[k], cut[k]) for k in whole)
    assert all(".lora_" in k for k in whole)  # the pairs alone are pieces
    exported = load_file(tmp_path / "whole" / "export" / "adapter_model.safetensors")
    assert json.loads((tmp_path / "whole" / "export" / "adapter_config.json").read_text()) == config
    assert any(k.endswith("lora_B.weight") and exported[k].any() for k in exported)  # the pairs trained


@pytest.mark.parametrize("flags,error", [
    (["--lora-targets", "q,v"], "LoRA target\\(s\\) q, v are not gpt2's \\(known: qkv, o, up, down\\)"),
    (["--dp", "2", "--stream"], "--lora-rank trains adapters resident or --stream in one process, or resident"),
    (["--lora-rank", "0"], "LoRA rank 0 must be >= 1")])
def test_lora_flags_refuse_what_they_cannot_do_in_one_line(offline_files, tmp_path, monkeypatch, flags, error):
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=error):
        main(["--model", "tiny", "--seq", "32", "--data", str(SHAKESPEARE), "--tokenizer-dir", str(TOKENIZER_DIR),
              "--lora-rank", "4", *flags])


def test_the_lora_bench_runs_on_a_cpu_in_seconds_and_refuses_a_real_size(capsys):
    from tasks.bench.lora import main

    peers = ["peft-lora"] * _has("peft") + ["peft-qlora"] * (_has("peft") and _has("bitsandbytes"))  # where installed
    main(["--model", "tiny-llama", "--device", "cpu", "--steps", "1", "--batch", "2", "--seq", "32",
          "--rows", ",".join(["ours-lora", "ours-qlora-stream", *peers])])
    out = capsys.readouterr().out
    assert all(f"{row} " in out for row in ["ours-lora", "ours-qlora-stream", *peers]) and "failed" not in out
    with pytest.raises(SystemExit, match="is a GPU benchmark"):
        main(["--model", "llama-3.1-8b", "--device", "cpu"])


def _has(package: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(package) is not None
