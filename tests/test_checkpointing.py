"""Every checkpointing policy gives the gradients of no checkpointing, with dropout on, and saves memory."""
import pytest
import torch

from nanotrain import model as M
from nanotrain.memory.recompute import CheckpointPolicy, block_grads, checkpointed_block
from nanotrain.models import preset
from nanotrain.tree import named_leaves
from tests.conftest import rel_err

CFG = preset("tiny", n_layer=4, vocab_size=512, embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1)


def _loss_and_grads(policy: CheckpointPolicy, seed: int = 11):
    params = M.init_params(CFG, seed=1)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    tokens = torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    targets = tokens.roll(-1, dims=1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        x = M.embed(params, tokens, CFG, seed)
        for i, p in enumerate(params["blocks"]):
            x = checkpointed_block(p, x, CFG, seed + 1 + i, policy, i)
        loss = M.head_loss(params, M.final_norm(params, x, CFG), targets)
    loss.backward()
    return loss.item(), [t.grad for t in leaves], sum(saved)


def test_policies_match_no_checkpointing():
    ref_loss, ref_grads, ref_bytes = _loss_and_grads(CheckpointPolicy("none"))
    # The model with dropout equals the plain model function too (same seeds, block i gets seed + 1 + i).
    params = M.init_params(CFG, seed=1)
    tokens = torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    assert M.loss(params, tokens, tokens.roll(-1, dims=1), CFG, seed=11).item() == ref_loss
    byte_counts = {}
    for text in ("every", "every-2", "every-3", "selective", "lean"):
        loss, grads, saved = _loss_and_grads(CheckpointPolicy.parse(text))
        assert loss == ref_loss, text
        for g, r in zip(grads, ref_grads):
            assert rel_err(g, r) <= 1e-6, text
        byte_counts[text] = saved
    assert byte_counts["every"] < byte_counts["every-2"] < ref_bytes
    assert byte_counts["selective"] < ref_bytes
    # lean keeps neither LayerNorm output (C each) nor the GELU output (4 C): 6 C fp32 values a token a block.
    tokens = 2 * 32
    assert ref_bytes - byte_counts["lean"] >= CFG.n_layer * tokens * 6 * CFG.n_embd * 4


def test_unknown_policy_names_the_choices():
    known = r"\(known: none, every, every-k, selective, lean\)"
    with pytest.raises(ValueError, match=r"unknown checkpoint policy 'sometimes' " + known):
        CheckpointPolicy.parse("sometimes")


def test_block_grads_skip_the_last_matmul_and_match_autograd():
    """``block_grads`` (the recompute behind ``every`` and streaming) against autograd through
    ``model.block``, dropout on, with a frozen weight: its gradient is None, the others equal."""
    p = {k: t.requires_grad_(k != "ln_1_b") for k, t in M.init_params(CFG, seed=2)["blocks"][0].items()}
    x = torch.randn(2, 16, CFG.n_embd, generator=torch.Generator().manual_seed(3)).requires_grad_()
    dy = torch.randn(2, 16, CFG.n_embd, generator=torch.Generator().manual_seed(4))
    out = M.block(p, x, CFG, seed=5)
    wanted = [x, *(t for t in p.values() if t.requires_grad)]
    ref = dict(zip(["x", *(k for k, t in p.items() if t.requires_grad)], torch.autograd.grad(out, wanted, dy)))
    dx, grads = block_grads(p, x, dy, CFG, seed=5)
    assert rel_err(dx, ref["x"]) <= 1e-6
    assert grads["ln_1_b"] is None
    for k, g in grads.items():
        if k != "ln_1_b":
            assert rel_err(g, ref[k]) <= 1e-6, k
