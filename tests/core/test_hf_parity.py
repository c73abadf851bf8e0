"""Our GPT-2 against transformers' GPT2LMHeadModel on the same files (fp32, CPU), both ways: folders
transformers wrote (one file, and sharded with an index) load in ours, ours load in transformers."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from nanotrain.core import models
from nanotrain.core.models import preset
from nanotrain.core.tree import get_path
from tests.conftest import assert_same_logits, chain_rtol, model_chain, rel_err
from weights import load_hf, load_weights, random_checkpoint, resolve_model, save_hf
from weights.table import table

CONFIGS = {
    "tiny": preset("tiny"),
    "gpt2-width-2-layers": preset("gpt2", n_layer=2),
}


def _hf(dir_):
    return GPT2LMHeadModel.from_pretrained(dir_, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_loss_and_every_gradient_match_transformers(name, tmp_path):
    cfg = CONFIGS[name]
    folder = random_checkpoint(cfg, seed=1, root=tmp_path)
    hf = _hf(folder)
    params = load_hf(folder, cfg)
    entries = table(cfg)
    leaves = {e.leaf: get_path(params, e.leaf).requires_grad_() for e in entries}
    tokens = torch.randint(0, cfg.vocab_size, (2, 48))

    out = hf(input_ids=tokens, labels=tokens)
    out.loss.backward()
    assert_same_logits(models.logits(params, tokens, cfg), out.logits, cfg)
    # the same sums in other orders on each side (conftest.chain_rtol)
    rtol = {what: chain_rtol(model_chain(cfg, tokens.shape[1], tokens.numel(), what)) for what in ("loss", "grads")}

    targets = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)  # HF shifts labels inside
    loss = models.loss(params, tokens, targets, cfg, chunk_tokens=37)
    assert abs(loss.item() - out.loss.item()) <= rtol["loss"] * abs(out.loss.item())
    loss.backward()

    hf_params = dict(hf.named_parameters())
    for e in entries:
        (part,) = e.parts
        hf_grad = hf_params[part.name].grad
        hf_grad = hf_grad.t() if e.transpose else hf_grad
        assert rel_err(leaves[e.leaf].grad, hf_grad) <= rtol["grads"], e.leaf


@pytest.mark.parametrize("shard_bytes", [None, 60_000])
def test_our_save_loads_in_transformers(tmp_path, shard_bytes):
    cfg = CONFIGS["tiny"]
    params = models.init_params(cfg, seed=3)
    save_hf(params, cfg, tmp_path, max_shard_bytes=shard_bytes)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard_bytes is not None)
    tokens = torch.randint(0, cfg.vocab_size, (2, 20))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    with torch.no_grad():
        assert_same_logits(models.logits(params, tokens, cfg), hf(tokens).logits, cfg)


@pytest.mark.parametrize("max_shard_size", [None, "100KB"])
def test_a_folder_transformers_wrote_loads_in_ours(tmp_path, max_shard_size):
    """GPT2LMHeadModel(config).save_pretrained, found by ``--model FOLDER``: its config.json gives the config."""
    torch.manual_seed(4)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=1000, bos_token_id=0,
                        eos_token_id=0)
    hf = GPT2LMHeadModel(config).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.save_pretrained(tmp_path, **kwargs)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (max_shard_size is not None)
    if max_shard_size:
        assert len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    model = resolve_model(str(tmp_path))
    assert model.cfg == preset("tiny", vocab_size=1000, embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1)
    params = load_weights(model.cfg, model.weights("hub"))
    tokens = torch.randint(0, 1000, (2, 20))
    with torch.no_grad():
        assert_same_logits(models.logits(params, tokens, model.cfg), hf(tokens).logits, model.cfg)


def test_random_checkpoint_equals_init_params(tmp_path):
    cfg = CONFIGS["tiny"]
    loaded = load_hf(random_checkpoint(cfg, seed=5, root=tmp_path), cfg)
    direct = models.init_params(cfg, seed=5)
    for e in table(cfg):
        assert torch.equal(get_path(loaded, e.leaf), get_path(direct, e.leaf)), e.leaf


def test_bf16_random_checkpoint_is_half_the_bytes_and_equals_the_cast_init(tmp_path):
    cfg = CONFIGS["tiny"]
    fp32, bf16 = (random_checkpoint(cfg, seed=6, dtype=d, root=tmp_path) for d in (torch.float32, torch.bfloat16))
    assert fp32 != bf16
    size = {f: (f / "model.safetensors").stat().st_size for f in (fp32, bf16)}
    assert size[bf16] < 0.51 * size[fp32]
    loaded = load_hf(bf16, cfg, dtype=torch.bfloat16)
    direct = models.init_params(cfg, seed=6, dtype=torch.bfloat16)
    for e in table(cfg):
        assert torch.equal(get_path(loaded, e.leaf), get_path(direct, e.leaf)), e.leaf
