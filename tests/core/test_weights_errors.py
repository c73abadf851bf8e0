"""Every bad checkpoint is one error line that names the file and the tensor; the hub fails at once offline."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanotrain.core.models import preset
from tests.conftest import REPO
from weights import CheckpointError, load_hf, load_weights, random_checkpoint, save_hf

TINY = preset("tiny")


@pytest.fixture
def ckpt(tmp_path):
    return random_checkpoint(TINY, root=tmp_path) / "model.safetensors"


@pytest.fixture
def sharded(tmp_path):
    """A tiny checkpoint in shards of at most 60 kB, with its index."""
    save_hf(load_hf(random_checkpoint(TINY, root=tmp_path), TINY), TINY, tmp_path / "sharded", max_shard_bytes=60_000)
    return tmp_path / "sharded"


def _rewrite(path, fn):
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _one_line(e: pytest.ExceptionInfo) -> None:
    assert "\n" not in str(e.value), str(e.value)


def test_missing_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"))
    with pytest.raises(CheckpointError, match=r"model.safetensors is missing tensor 'transformer.h.1.mlp.c_fc.bias' "
                                              r"\(blocks.1.fc_b of a gpt2 model of 2 layers x 64 wide") as e:
        load_hf(ckpt, TINY)
    _one_line(e)


def test_unexpected_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.update({"transformer.h.2.ln_1.weight": torch.ones(64)}))
    with pytest.raises(CheckpointError, match=r"model.safetensors has tensors a gpt2 model of 2 layers x 64 wide does "
                                              r"not: transformer.h.2.ln_1.weight"):
        load_hf(ckpt, TINY)


def test_misshapen_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.update({"transformer.h.0.attn.c_attn.weight": torch.zeros(192, 64)}))
    with pytest.raises(CheckpointError, match=r"'transformer.h.0.attn.c_attn.weight' in .*model.safetensors has shape "
                                              r"\(192, 64\), expected \(64, 192\)"):
        load_hf(ckpt, TINY)


def test_wrong_model_for_file(ckpt):
    with pytest.raises(CheckpointError, match="wrong --model for this checkpoint"):
        load_hf(ckpt, preset("gpt2"))


def test_truncated_file(ckpt):
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])
    unreadable = r"model.safetensors is not a readable safetensors file \(corrupt or truncated"
    with pytest.raises(CheckpointError, match=unreadable):
        load_hf(ckpt, TINY)


def test_corrupt_header(ckpt):
    data = bytearray(ckpt.read_bytes())
    data[8:20] = b"not json!!!!"
    ckpt.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_hf(ckpt, TINY)


def test_missing_file_and_empty_folder(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint file not found: .*nothing.safetensors"):
        load_hf(tmp_path / "nothing.safetensors", TINY)
    with pytest.raises(CheckpointError, match=r"holds neither model.safetensors nor model.safetensors.index.json"):
        load_weights(TINY, str(tmp_path))


def test_tied_copy_that_differs_is_refused(ckpt):
    _rewrite(ckpt, lambda t: t.update({"lm_head.weight": torch.zeros_like(t["transformer.wte.weight"])}))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'lm_head.weight' differs from wte, the "
                                              r"embedding the model's head is tied to"):
        load_hf(ckpt, TINY)


def test_old_checkpoint_buffers_unprefixed_names_and_an_equal_tied_copy_are_accepted(ckpt):
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(ckpt).items()}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 128, 128)  # the causal-mask buffer old files carry
    tensors["lm_head.weight"] = tensors["wte.weight"].clone()
    save_file(tensors, ckpt, metadata={"format": "pt"})
    load_hf(ckpt, TINY)


def test_sharded_checkpoint_missing_a_shard(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["transformer.ln_f.bias"]
    (sharded / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"model.safetensors.index.json puts tensor '.*' in shard {shard}, "
                                              rf"which is not in .*sharded \(an incomplete download\?\)") as e:
        load_weights(TINY, str(sharded))
    _one_line(e)


def test_sharded_checkpoint_errors_name_the_shard_or_the_index(sharded):
    path = sharded / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    shard = index["weight_map"]["transformer.h.1.ln_2.weight"]
    _rewrite(sharded / shard, lambda t: t.update({"transformer.h.1.ln_2.weight": torch.ones(65)}))
    with pytest.raises(CheckpointError, match=rf"'transformer.h.1.ln_2.weight' in .*{shard} has shape \(65,\), "
                                              rf"expected \(64,\)"):
        load_hf(sharded, TINY)
    del index["weight_map"]["transformer.h.1.ln_2.weight"]
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json is missing tensor "
                                              r"'transformer.h.1.ln_2.weight'"):
        load_hf(sharded, TINY)
    path.write_text("{}")
    with pytest.raises(CheckpointError, match=r"index.json is not a safetensors index \(JSON with a 'weight_map'\)"):
        load_hf(sharded, TINY)


def test_no_hub_weights_for_tiny():
    with pytest.raises(CheckpointError, match=r"no pretrained hub weights for model 'tiny' \(hub models: gpt2, "):
        load_weights(TINY, "hub")


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}],
                         ids=["HF_HUB_OFFLINE", "unreachable"])
@pytest.mark.parametrize("code, fix", [
    ("from weights import load_weights; from nanotrain.core.models import preset; load_weights(preset('gpt2-large'), 'hub')",
     "--weights /path/to/folder"),
    ("from weights import resolve_model; resolve_model('meta-llama/Llama-3.2-1B')", "--model /path/to/folder"),
], ids=["weights", "model"])
def test_hub_offline_fails_at_once_in_one_line(tmp_path, env, code, fix):
    """huggingface_hub alone retries for about 25 s before it says the machine is offline."""
    env = dict(os.environ, HF_HOME=str(tmp_path), **env)
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode != 0 and time.monotonic() - start < 15
    line = r.stderr.strip().splitlines()[-1]
    assert "is not in the Hugging Face cache and" in line and fix in line and "hf download" in line, r.stderr
