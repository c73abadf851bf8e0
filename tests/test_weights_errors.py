"""Every bad checkpoint is an error that names the tensor and the file."""
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanotrain.models import preset
from weights import CheckpointError, fetch, load_gpt2, write_random_gpt2

TINY = preset("tiny")


@pytest.fixture
def ckpt(tmp_path):
    return write_random_gpt2(TINY, tmp_path / "model.safetensors")


def _rewrite(path, fn):
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"))
    with pytest.raises(CheckpointError, match=r"model.safetensors is missing tensor 'transformer.h.1.mlp.c_fc.bias'"):
        load_gpt2(ckpt, TINY)


def test_unexpected_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.update({"transformer.h.2.ln_1.weight": torch.ones(64)}))
    with pytest.raises(CheckpointError, match=r"tensors a 2-layer GPT-2 does not: transformer.h.2.ln_1.weight"):
        load_gpt2(ckpt, TINY)


def test_misshapen_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.update({"transformer.h.0.attn.c_attn.weight": torch.zeros(192, 64)}))
    with pytest.raises(CheckpointError, match=r"'transformer.h.0.attn.c_attn.weight' in .*model.safetensors has shape "
                                              r"\(192, 64\), expected \(64, 192\)"):
        load_gpt2(ckpt, TINY)


def test_wrong_preset_for_file(ckpt):
    with pytest.raises(CheckpointError, match="wrong --model preset"):
        load_gpt2(ckpt, preset("gpt2"))


def test_truncated_file(ckpt):
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])
    unreadable = r"model.safetensors is not a readable safetensors file \(corrupt or truncated"
    with pytest.raises(CheckpointError, match=unreadable):
        load_gpt2(ckpt, TINY)


def test_corrupt_header(ckpt):
    data = bytearray(ckpt.read_bytes())
    data[8:20] = b"not json!!!!"
    ckpt.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_gpt2(ckpt, TINY)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint file not found: .*nothing.safetensors"):
        load_gpt2(tmp_path / "nothing.safetensors", TINY)


def test_untied_head_is_refused(ckpt):
    _rewrite(ckpt, lambda t: t.update({"lm_head.weight": torch.zeros_like(t["transformer.wte.weight"])}))
    with pytest.raises(CheckpointError, match="lm_head.weight differs from the token embedding"):
        load_gpt2(ckpt, TINY)


def test_old_checkpoint_buffers_and_unprefixed_names_are_accepted(ckpt):
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(ckpt).items()}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 128, 128)  # the causal-mask buffer old files carry
    save_file(tensors, ckpt, metadata={"format": "pt"})
    load_gpt2(ckpt, TINY)


def test_hub_without_network_says_what_to_do(tmp_path):
    with pytest.raises(CheckpointError, match=r"openai-community/gpt2/model.safetensors.*--weights /path/to/"
                                              r"model.safetensors.*--weights random"):
        fetch("gpt2", cache_dir=tmp_path, local_files_only=True)


def test_hub_offline_mode_in_a_fresh_process(tmp_path):
    code = "from weights import fetch; fetch('gpt2-large')"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--weights random" in r.stderr


def test_no_hub_weights_for_tiny():
    with pytest.raises(CheckpointError, match=r"no pretrained hub weights for model 'tiny'"):
        fetch("tiny")
