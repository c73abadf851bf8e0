"""Our GPT-2 against transformers' GPT2LMHeadModel loaded from the same safetensors file (fp32, CPU)."""
import pytest
import torch
from transformers import GPT2LMHeadModel

from nanotrain import model as M
from nanotrain.models import preset
from nanotrain.tree import get_path
from tests.conftest import rel_err
from weights import load_gpt2, save_gpt2, write_random_gpt2
from weights.names import name_table

CONFIGS = {
    "tiny": preset("tiny"),
    "gpt2-width-2-layers": preset("gpt2", n_layer=2),
}


def _hf(dir_):
    return GPT2LMHeadModel.from_pretrained(dir_, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_loss_and_every_gradient_match_transformers(name, tmp_path):
    cfg = CONFIGS[name]
    write_random_gpt2(cfg, tmp_path / "model.safetensors", seed=1)
    hf = _hf(tmp_path)
    params = load_gpt2(tmp_path / "model.safetensors", cfg)
    leaves = {e.ours: get_path(params, e.ours).requires_grad_() for e in name_table(cfg)}
    tokens = torch.randint(0, cfg.vocab_size, (2, 48))

    out = hf(input_ids=tokens, labels=tokens)
    out.loss.backward()
    ours_logits = M.logits(params, tokens, cfg)
    assert (ours_logits - out.logits).abs().max().item() <= 1e-5

    targets = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)  # HF shifts labels inside
    loss = M.loss(params, tokens, targets, cfg, chunk_tokens=37)
    assert abs(loss.item() - out.loss.item()) <= 1e-5 * abs(out.loss.item())
    loss.backward()

    hf_params = dict(hf.transformer.named_parameters())
    for e in name_table(cfg):
        hf_grad = hf_params[e.hf].grad
        hf_grad = hf_grad.t() if e.transpose else hf_grad
        assert rel_err(leaves[e.ours].grad, hf_grad) <= 1e-5, e.ours


def test_our_save_loads_in_transformers(tmp_path):
    cfg = CONFIGS["tiny"]
    params = M.init_params(cfg, seed=3)
    save_gpt2(params, cfg, tmp_path)
    tokens = torch.randint(0, cfg.vocab_size, (2, 20))
    with torch.no_grad():
        assert torch.allclose(_hf(tmp_path)(tokens).logits, M.logits(params, tokens, cfg), atol=1e-5, rtol=0)


def test_transformers_save_pretrained_loads_in_ours(tmp_path):
    cfg = CONFIGS["tiny"]
    write_random_gpt2(cfg, tmp_path / "src" / "model.safetensors", seed=4)
    hf = _hf(tmp_path / "src")
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    params = load_gpt2(tmp_path / "hf" / "model.safetensors", cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 20))
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, M.logits(params, tokens, cfg), atol=1e-5, rtol=0)


def test_random_checkpoint_equals_init_params(tmp_path):
    cfg = CONFIGS["tiny"]
    loaded = load_gpt2(write_random_gpt2(cfg, tmp_path / "model.safetensors", seed=5), cfg)
    direct = M.init_params(cfg, seed=5)
    for e in name_table(cfg):
        assert torch.equal(get_path(loaded, e.ours), get_path(direct, e.ours)), e.ours
