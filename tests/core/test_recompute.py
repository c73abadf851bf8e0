"""Every recompute policy gives the gradients of no recompute, with dropout on, and saves memory: on GPT-2 and
on the Llama class (``tiny-llama``: RMSNorm, SwiGLU on a fused gate|up 100 wide, 6 query heads over 2 key/value
heads, no biases, attention dropout; tied, Qwen2's q/k/v biases, Qwen3's per-head q/k norms)."""
from dataclasses import replace

import pytest
import torch

from nanotrain.core import models
from nanotrain.core.recompute import RecomputePolicy, block_grads
from nanotrain.core.models import model_spec, preset, run
from nanotrain.core.tree import named_leaves
from tests.conftest import chain_rtol, model_chain, rel_err

CFG = preset("tiny", n_layer=4, vocab_size=512, embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1)
LLAMA = preset("tiny-llama", n_layer=4, attention_dropout=0.1)
SPECS = {"gpt2": model_spec(CFG), "llama": model_spec(LLAMA),
         "tied-llama": model_spec(preset("tiny-llama", n_layer=4, tie_word_embeddings=True, attention_dropout=0.1)),
         "qwen2": model_spec(preset("tiny-llama", n_layer=4, architecture="qwen2", attention_dropout=0.1)),
         "qwen3": model_spec(preset("tiny-llama", n_layer=4, architecture="qwen3", attention_dropout=0.1))}


def _loss_and_grads(spec, policy: RecomputePolicy, seed: int = 11):
    params = models.init_params(spec, seed=1)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    tokens = torch.randint(0, spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    targets = tokens.roll(-1, dims=1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        loss = run.run_units(spec, params, tokens, targets, seed=seed, block_fn=policy.block_fn(spec))
    loss.backward()
    return loss.item(), [t.grad for t in leaves], sum(saved)


@pytest.mark.parametrize("name", SPECS)
def test_policies_match_no_recompute(name):
    spec = SPECS[name]
    ref_loss, ref_grads, ref_bytes = _loss_and_grads(spec, RecomputePolicy("none"))
    # The model with dropout equals the plain model function too (same seeds, block i gets seed + 1 + i).
    params = models.init_params(spec, seed=1)
    tokens = torch.randint(0, spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    assert models.loss(params, tokens, tokens.roll(-1, dims=1), spec, seed=11).item() == ref_loss
    byte_counts = {}
    for text in ("every", "every-2", "every-3", "selective", "lean"):
        loss, grads, saved = _loss_and_grads(spec, RecomputePolicy.parse(text))
        assert loss == ref_loss, text
        for g, r in zip(grads, ref_grads):  # recomputed blocks sum some gradients in another order (lean: norms')
            assert rel_err(g, r) <= chain_rtol(model_chain(spec.cfg, 32, 64)), text
        byte_counts[text] = saved
    assert byte_counts["every"] < byte_counts["every-2"] < ref_bytes
    assert byte_counts["selective"] < ref_bytes
    # lean keeps neither norm's output (C each) nor the activation's output (the MLP's width: 4 C for GPT-2):
    # that many fp32 values a token a block fewer at least.
    tokens, c = 2 * 32, spec.costs.width
    assert ref_bytes - byte_counts["lean"] >= spec.n_layer * tokens * (2 * c + spec.mlp_width) * 4


def test_unknown_policy_names_the_choices():
    known = r"\(known: none, every, every-k, selective, lean\)"
    with pytest.raises(ValueError, match=r"unknown recompute policy 'sometimes' " + known):
        RecomputePolicy.parse("sometimes")


@pytest.mark.parametrize("name,frozen", [("gpt2", "ln_1_b"), ("llama", "attn_norm_w"), ("qwen2", "qkv_b"),
                                         ("qwen3", "k_norm_w")])
def test_block_grads_skip_the_last_matmul_and_match_autograd(name, frozen):
    """``block_grads`` (the recompute behind ``every`` and streaming) against autograd through
    ``run.block``, dropout on, with a frozen weight: its gradient is None, the others equal."""
    spec = SPECS[name]
    p = {k: t.requires_grad_(k != frozen) for k, t in models.init_params(spec, seed=2)["blocks"][0].items()}
    x = torch.randn(2, 16, spec.costs.width, generator=torch.Generator().manual_seed(3)).requires_grad_()
    dy = torch.randn(2, 16, spec.costs.width, generator=torch.Generator().manual_seed(4))
    out = run.block(spec, p, x, seed=5)
    wanted = [x, *(t for t in p.values() if t.requires_grad)]
    ref = dict(zip(["x", *(k for k, t in p.items() if t.requires_grad)], torch.autograd.grad(out, wanted, dy)))
    dx, grads = block_grads(spec, p, x, dy, seed=5)
    rtol = chain_rtol(model_chain(replace(spec.cfg, n_layer=1), 16, 32))  # one block's chain (and a head's: more)
    assert rel_err(dx, ref["x"]) <= rtol
    assert grads[frozen] is None
    for k, g in grads.items():
        if k != frozen:
            assert rel_err(g, ref[k]) <= rtol, k
