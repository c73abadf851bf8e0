"""Which tokenizer a preset reads text with (``Family.tokenizer``): GPT-2's BPE for GPT-2's family; for the Llama
class its hub repository's ``tokenizer.json``, from the Hugging Face cache without the network, else fetched with
its config.json. Offline and not cached, a run that reads text says in one line to pass ``--tokenizer-dir`` (or
token files); a run on token files (``.bin``, ``.npy``) asks for no tokenizer at all, and ``tiny-llama``, which has
no hub repository, takes one from ``--tokenizer-dir``."""
import pytest

from nanotrain.run.cli import model_tokenizer
from nanotrain.core.models.family import GPT2_BPE, HUB_TOKENIZER_JSON
from nanotrain.core.models.registry import FAMILIES
from tests.core.test_model_folders import refused
from tests.data.test_tokenizer_hf import write_tokenizer
from weights import CheckpointError, resolve_model

FIX = r"pass --tokenizer-dir DIR \(a folder with its tokenizer.json\), or --data a .bin/.npy token file"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache and a hub that cannot be reached; returns the cache folder."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    return tmp_path / "hub"


def test_each_family_says_which_tokenizer_its_presets_use():
    assert FAMILIES["gpt2"].tokenizer == GPT2_BPE and FAMILIES["llama"].tokenizer == HUB_TOKENIZER_JSON
    assert resolve_model("gpt2-large").tokenizer_folder() is None  # GPT-2's BPE through tiktoken


def test_a_llama_preset_reads_its_hub_tokenizer_from_the_cache_without_the_network(hub_cache):
    snapshot = hub_cache / "models--meta-llama--Llama-3.2-1B" / "snapshots" / "abc123"
    model = resolve_model("llama-3.2-1b")
    assert model.tokenizer_folder() is None  # not at hand: nothing fetched to say so
    write_tokenizer(snapshot)
    (snapshot / "config.json").write_text("{}")  # the preset's config is ours; the file only comes along
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc123")
    assert model.tokenizer_folder() == model.fetch_tokenizer_folder() == snapshot
    tok = model_tokenizer(model, None)
    assert (tok.n_vocab, tok.bos_id, tok.eos_id) == (300, 0, 1)


def test_a_llama_preset_offline_and_not_cached_asks_for_tokenizer_dir_in_one_line(hub_cache, capsys):
    from tasks.generate import main

    with pytest.raises(CheckpointError, match=r"meta-llama/Llama-3.2-1B is not in the Hugging Face cache and .* "
                                              r"cannot be reached .*; on a machine without network, download it "
                                              rf"elsewhere \(hf download meta-llama/Llama-3.2-1B\) and {FIX}"):
        resolve_model("llama-3.2-1b").fetch_tokenizer_folder()
    refused(main, ["--model", "llama-3.2-1b", "--weights", "random"], rf"error: .*{FIX}", capsys)


def test_tiny_llama_has_no_tokenizer_of_its_own_and_takes_one_from_tokenizer_dir(tmp_path, capsys):
    from tasks.generate import main

    with pytest.raises(CheckpointError, match=rf"^tiny-llama \(llama\) reads text with its own tokenizer.json, and it "
                                              rf"has no hub repository; {FIX}"):
        resolve_model("tiny-llama").fetch_tokenizer_folder()
    refused(main, ["--model", "tiny-llama", "--weights", "random"], rf"error: tiny-llama .*{FIX}", capsys)
    write_tokenizer(tmp_path / "tok")
    main(["--model", "tiny-llama", "--weights", "random", "--tokenizer-dir", str(tmp_path / "tok"), "--prompt",
          "The dog", "--max-new-tokens", "3"])
    assert "--- sample 0 ---\nThe dog" in capsys.readouterr().out


def test_a_llama_folder_without_a_tokenizer_json_is_not_read_with_gpt2s(tmp_path):
    from weights import save_hf
    from nanotrain.core import models
    from nanotrain.core.models import preset
    cfg = preset("tiny-llama")
    save_hf(models.init_params(cfg, seed=0), cfg, tmp_path / "m")
    with pytest.raises(CheckpointError, match=rf"reads text with its own tokenizer.json, and its folder .*m has none; "
                                              rf"{FIX}"):
        resolve_model(str(tmp_path / "m")).fetch_tokenizer_folder()


def test_finetune_trains_a_llama_preset_on_a_token_file_without_tokenizer_or_network(hub_cache, tmp_path, capsys):
    """Random weights and a .bin of random uint32 ids: a speed run on a machine without network or tokenizer. The
    same run on text says in one line what it needs."""
    import numpy as np

    from tasks.finetune import main

    np.random.default_rng(0).integers(0, 320, 20_000, dtype=np.uint32).tofile(tmp_path / "ids.bin")
    run = ["--model", "tiny-llama", "--weights", "random", "--batch", "4", "--seq", "32", "--steps", "2",
           "--no-tensorboard"]
    main([*run, "--data", str(tmp_path / "ids.bin"), "--data-dtype", "uint32", "--out", str(tmp_path / "run")])
    assert "step     2 | loss 5.7" in capsys.readouterr().out  # ln 320 = 5.77: random weights, random ids
    (tmp_path / "text.txt").write_text("The lazy fox. " * 2000)
    refused(main, [*run, "--data", str(tmp_path / "text.txt"), "--out", str(tmp_path / "run2")],
            rf"error: tiny-llama .*{FIX}", capsys)
