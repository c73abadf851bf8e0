"""LoRA against PEFT on ``transformers``' GPT-2 and Llama (fp32, CPU): the loss and every adapter gradient, and our
adapter folder (``weights.peft``) loaded by ``peft.PeftModel.from_pretrained`` giving our logits.

Bounds as in ``test_llama_parity``: both sides in fp32 with the same operations in other orders (a fused q|k|v
matmul against three, chunked cross-entropy against whole): ``conftest.chain_rtol`` of the adapted model's chain
(each pair's rank-r contraction too, ``model_chain`` of the spec), which catches a wrong row, scale or transpose
(>= 1e-2).
"""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from nanotrain.core.models import family_of, model_spec, preset, run
from nanotrain.core.models.lora import LoraConfig, with_lora
from nanotrain.core.tree import get_path
from tests.conftest import assert_same_logits, chain_rtol, model_chain, rel_err
from weights.table import table
from weights.peft import load_adapter, module, peft_keys, save_adapter

peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft: the test extra)")

CASES = {"gpt2": (preset("tiny", n_layer=2, vocab_size=256, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0),
                  ("qkv", "o", "up", "down")),
         "llama": (preset("tiny-llama"), ("q", "k", "v", "o", "gate", "up", "down")),
         "llama-q-v": (preset("tiny-llama", tie_word_embeddings=True), ("q", "v"))}


def hf_model(cfg):
    hf_cfg = AutoConfig.for_model(**family_of(cfg).hf.to_config(cfg))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


def peft_model(cfg, spec):
    """PEFT's LoRA on ``transformers``' model with its own init, then every B drawn non-zero (zeros would give A
    no gradient); and our base tree holding the same base tensors (through the family's name table)."""
    hf = hf_model(cfg)
    named = dict(hf.named_parameters())
    base = run.tree_from(model_spec(cfg), ((e.leaf, e.from_file([named[p.name].detach() for p in e.parts]))
                                           for e in table(cfg)))
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[module(spec, a) for a in spec.adapters],
                           fan_in_fan_out=spec.family == "gpt2")
    model = peft.get_peft_model(hf, lcfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model, base


def ours_from(spec, model, base):
    """Our adapted tree: ``base`` and the PEFT model's adapters (needing gradients); our path -> PEFT's name."""
    named = dict(model.named_parameters())
    live = {path: key.replace(".weight", ".default.weight") for path, key in peft_keys(spec).items()}
    leaves = [(leaf.path, get_path(base, leaf.path)) for leaf in spec.leaves if not leaf.trainable]
    leaves += [(path, named[key].detach().clone().requires_grad_()) for path, key in live.items()]
    return run.tree_from(spec, leaves), live


def shifted(tokens):
    return torch.cat([tokens[:, 1:], torch.full((tokens.shape[0], 1), -100)], dim=1)


@pytest.mark.parametrize("name", CASES)
def test_loss_and_adapter_gradients_equal_peft(name):
    cfg, targets = CASES[name]
    spec = with_lora(model_spec(cfg), LoraConfig(4, 8.0, targets))
    model, base = peft_model(cfg, spec)
    params, live = ours_from(spec, model, base)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()
    ours = run.loss(spec, params, tokens, shifted(tokens), chunk_tokens=11)
    seq, count = tokens.shape[1], int((shifted(tokens) != -100).sum())
    loss_rtol, grad_rtol = (chain_rtol(model_chain(spec, seq, count, what)) for what in ("loss", "grads"))
    assert abs(ours.item() - out.loss.item()) <= loss_rtol * out.loss.item()
    ours.backward()
    named = dict(model.named_parameters())
    for path, key in live.items():
        assert rel_err(get_path(params, path).grad, named[key].grad) <= grad_rtol, path
    assert not [n for n, p in named.items() if p.requires_grad and "lora_" not in n]  # PEFT froze the base too


@pytest.mark.parametrize("name", CASES)
def test_our_adapter_folder_loads_in_peft_with_our_logits(name, tmp_path):
    cfg, targets = CASES[name]
    spec = with_lora(model_spec(cfg), LoraConfig(4, 8.0, targets))
    params, _ = ours_from(spec, *peft_model(cfg, spec))
    save_adapter(tmp_path, spec, params, base_model="tiny")
    loaded = peft.PeftModel.from_pretrained(hf_model(cfg), tmp_path).eval()  # the same base (same seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = loaded(input_ids=tokens).logits
        mine = run.logits(spec, params, tokens)
    assert_same_logits(mine, theirs, spec)
    back = load_adapter(tmp_path, spec)
    assert all(torch.equal(t, get_path(params, p).detach()) for p, t in back.items())
