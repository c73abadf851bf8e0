"""``--model`` as a Hugging Face folder: the family and config from its config.json, its weights and its own
tokenizer; every bad folder one ``error:`` line (exit status 2) before any weights are read; an exported
sharded checkpoint is a folder transformers loads with equal logits."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from nanotrain.core import models
from nanotrain.core.models import preset
from tests.conftest import SHAKESPEARE, TOKENIZER_DIR, assert_same_logits
from tests.data.test_tokenizer_hf import write_tokenizer
from weights import CheckpointError, load_weights, resolve_model



def hf_folder(folder, vocab_size: int = 50257, **save):
    """A 2-layer GPT-2 that transformers wrote, with a small tokenizer.json of its own."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=vocab_size, bos_token_id=0,
                        eos_token_id=1)
    GPT2LMHeadModel(config).save_pretrained(folder, **save)
    write_tokenizer(folder)
    return folder


def refused(main, argv, pattern, capsys):
    capsys.readouterr()  # what building the folder printed
    with pytest.raises(SystemExit, match=pattern) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_resolve_preset_folder_and_bad_names(tmp_path):
    assert resolve_model("tiny").cfg == preset("tiny") and resolve_model("tiny").folder is None
    model = resolve_model(str(hf_folder(tmp_path / "m")))
    assert model.cfg == preset("tiny", embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1)
    assert model.tokenizer_folder() == tmp_path / "m" and model.weights("hub") == str(tmp_path / "m")
    known = r"unknown model 'gpt2-lrage': not a preset \(known: gpt2, .*\), a folder"
    with pytest.raises(CheckpointError, match=known):
        resolve_model("gpt2-lrage")
    with pytest.raises(CheckpointError, match=r"has no config.json: not a model folder in the Hugging Face layout"):
        resolve_model(str(tmp_path))


def test_generate_from_a_folder_with_its_own_tokenizer(tmp_path, capsys):
    from tasks.generate import main

    folder = hf_folder(tmp_path / "m")
    main(["--model", str(folder), "--prompt", "The lazy fox", "--max-new-tokens", "4", "--temperature", "0"])
    out = capsys.readouterr().out
    assert "--- sample 0 ---\nThe lazy fox" in out  # the folder's tokenizer, its BOS dropped from the print


@pytest.mark.parametrize("spoil, pattern", [
    (lambda f: (f / "config.json").write_text(json.dumps({**json.loads((f / "config.json").read_text()),
                                                           "model_type": "bert"})),
     r"config.json: config.json's model_type 'bert' is not one nanotrain trains "
     r"\(known: gpt2, llama, mistral, qwen2, qwen3\)"),
    (lambda f: (f / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64})),
     r"config.json lacks the field 'n_layer'"),
    (lambda f: (f / "model-00002-of-00002.safetensors").unlink(),
     r"model.safetensors.index.json puts tensor '.*' in shard model-00002-of-00002.safetensors, which is not in"),
    (lambda f: save_file({**load_file(f / "model-00002-of-00002.safetensors"),
                          "transformer.h.0.ln_1.weight": torch.ones(32)}, f / "model-00002-of-00002.safetensors",
                         metadata={"format": "pt"}),
     r"tensor 'transformer.h.0.ln_1.weight' in .*model-00002-of-00002.safetensors has shape \(32,\), expected \(64,\)"),
])
def test_generate_refuses_a_bad_folder_in_one_line(tmp_path, capsys, spoil, pattern):
    from tasks.generate import main

    folder = hf_folder(tmp_path / "m", max_shard_size="2MB")
    assert (folder / "model-00002-of-00002.safetensors").is_file()
    spoil(folder)
    refused(main, ["--model", str(folder), "--max-new-tokens", "2"], pattern, capsys)


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path, capsys):
    from tasks.generate import main

    folder = hf_folder(tmp_path / "m", vocab_size=200)
    refused(main, ["--model", str(folder), "--max-new-tokens", "2"],
            r"the tokenizer \(.*m\) has 300 tokens, more than the 200 embeddings of .*m; pass --tokenizer-dir", capsys)


def test_export_of_a_sharded_checkpoint_loads_in_transformers_with_its_tokenizer(offline_files, tmp_path,
                                                                                 monkeypatch):
    from tasks.consolidate import main as consolidate
    from tasks.finetune import main as finetune

    monkeypatch.chdir(tmp_path)
    folder = hf_folder(tmp_path / "m")
    finetune(["--model", str(folder), "--weights", str(folder), "--batch", "4", "--micro-batch", "2", "--seq", "32",
              "--steps", "1", "--data", str(SHAKESPEARE), "--tokenizer-dir", str(TOKENIZER_DIR), "--out", "run",
              "--dp", "2", "--zero", "1", "--sharded-save"])
    consolidate(["run/step-000001", "--out", "hf"])
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()}
    cfg = resolve_model("hf").cfg
    ours = load_weights(cfg, "hf")
    hf = AutoModelForCausalLM.from_pretrained("hf", attn_implementation="sdpa", dtype=torch.float32).eval()  # bf16
    tokens = torch.tensor([AutoTokenizer.from_pretrained("hf")("The lazy fox jumps")["input_ids"]])
    with torch.no_grad():
        assert_same_logits(models.logits(ours, tokens, cfg), hf(tokens).logits, cfg)


def test_a_hub_id_in_the_local_cache_needs_no_network(tmp_path, monkeypatch, capsys):
    """The Hugging Face cache's layout (refs/main -> snapshots/<commit>/files) holding a model, and a hub that
    cannot be reached: ``--model owner/name`` finds config, tokenizer and weights there."""
    from huggingface_hub import constants

    from tasks.generate import main

    repo = tmp_path / "hub" / "models--someone--tiny-gpt2"
    hf_folder(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    main(["--model", "someone/tiny-gpt2", "--prompt", "The dog", "--max-new-tokens", "3"])
    assert "--- sample 0 ---\nThe dog" in capsys.readouterr().out
