"""Model-level behaviour: presets, input checks, chunked loss, dropout replay (generation: test_generate.py)."""
import pytest
import torch
import torch.nn.functional as F

from nanotrain.core import models as M
from nanotrain.core.models import model_spec, preset
from nanotrain.core.linear import apply_weight_grads, deferring_weight_grads
from nanotrain.core.loss import chunked_cross_entropy, kept_logits_cross_entropy
from tests.conftest import chain_rtol, rel_err

TINY = preset("tiny")


def test_presets_and_unknown_name():
    assert preset("gpt2-large").n_layer == 36
    assert preset("gpt2-xl").n_embd == 1600
    assert model_spec(preset("gpt2")).costs.total_params == 124_439_808  # transformers' count
    with pytest.raises(ValueError, match=r"unknown model 'gpt2-lrage' \(known: gpt2, gpt2-medium, gpt2-large, gpt2-xl"):
        preset("gpt2-lrage")


def test_sequence_longer_than_context_is_refused():
    params = M.init_params(TINY)
    tokens = torch.zeros(1, TINY.n_ctx + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"sequence length 129 exceeds the model's context of 128"):
        M.logits(params, tokens, TINY)


def test_token_id_outside_vocab_is_refused():
    params = M.init_params(TINY)
    tokens = torch.tensor([[1, 2, TINY.vocab_size]])
    with pytest.raises(ValueError, match=r"token id 50257 is outside the vocabulary \[0, 50257\)"):
        M.loss(params, tokens, tokens, TINY)


@pytest.mark.parametrize("chunk", [1, 5, 64, 10_000])
def test_chunked_loss_equals_unchunked(chunk):
    h = torch.randn(40, 16, requires_grad=True)
    w = torch.randn(300, 16, requires_grad=True)
    t = torch.randint(0, 300, (40,))
    t[::7] = -100
    loss = chunked_cross_entropy(h, w, t, chunk_tokens=chunk)
    loss.backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy(h2 @ w2.t(), t, ignore_index=-100)
    ref.backward()
    # chunks sum in other orders (conftest.chain_rtol): the logits over 16, the log-sum-exp over 300, the mean over
    # 40 tokens; backward, the input's gradient over the 300 logits, the weight's over the 40 tokens
    assert abs(loss.item() - ref.item()) <= chain_rtol([16, 300, 40]) * ref.item()
    grad_rtol = chain_rtol([16, 300, 300, 40])
    assert rel_err(h.grad, h2.grad) <= grad_rtol and rel_err(w.grad, w2.grad) <= grad_rtol


@pytest.mark.parametrize("defer", [False, True])
def test_kept_logits_loss_equals_the_fused_one(defer):
    """Gradients in backward from kept logits (a pipeline's last stage), the weight's optionally in a W pass."""
    g = torch.Generator().manual_seed(0)
    h0, w0 = torch.randn(40, 16, generator=g), torch.randn(300, 16, generator=g)
    t = torch.randint(0, 300, (40,), generator=g)
    t[::7] = -100
    results = []
    for kept in (False, True):
        h, w, pending = h0.clone().requires_grad_(), w0.clone().requires_grad_(), []
        with deferring_weight_grads(pending) if kept and defer else torch.enable_grad():
            loss = (kept_logits_cross_entropy if kept else chunked_cross_entropy)(h, w, t, 34, chunk_tokens=16)
        (2 * loss).backward()
        assert (w.grad is None) == (kept and defer)
        apply_weight_grads(pending)
        results.append((loss.detach(), h.grad, w.grad))
    for fused, kept in zip(*results):  # the loss's chain and its gradients' (as above)
        assert rel_err(kept, fused) <= chain_rtol([16, 300, 300, 40])


def test_loss_denominator_makes_micro_batch_losses_add_up():
    h, w = torch.randn(30, 8), torch.randn(50, 8)
    t = torch.randint(0, 50, (30,))
    t[:4] = -100
    whole = chunked_cross_entropy(h, w, t)
    parts = sum(chunked_cross_entropy(h[i:i + 10], w, t[i:i + 10], denom=26) for i in (0, 10, 20))
    assert abs(whole.item() - parts.item()) <= chain_rtol([8, 50, 30]) * whole.item()  # logits, lse, the sum


def test_all_ignored_targets_give_zero_not_nan():
    h = torch.randn(4, 8, requires_grad=True)
    loss = chunked_cross_entropy(h, torch.randn(50, 8), torch.full((4,), -100))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(h.grad == 0)


def test_dropout_masks_replay_from_the_seed():
    cfg = preset("tiny", embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1)
    params = M.init_params(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    a = M.hidden_states(params, tokens, cfg, seed=7)
    assert torch.equal(a, M.hidden_states(params, tokens, cfg, seed=7))
    assert not torch.equal(a, M.hidden_states(params, tokens, cfg, seed=8))
    assert not torch.equal(a, M.hidden_states(params, tokens, cfg))  # no seed: eval, no dropout


