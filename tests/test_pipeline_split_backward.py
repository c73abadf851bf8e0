"""The I + W split of backward gives autograd's gradients, and W really is deferred."""
from __future__ import annotations

import torch

from nanotrain.models import preset
from nanotrain.model import init_params, loss
from nanotrain.pipeline.split_backward import apply_weight_grads, deferring_weight_grads
from nanotrain.tree import named_leaves

CFG = preset("tiny", n_layer=2, n_embd=32, n_head=4, n_ctx=16, vocab_size=256)


def grads(split: bool) -> dict[str, torch.Tensor]:
    params = init_params(CFG, seed=0)
    leaves = dict(named_leaves(params))
    for t in leaves.values():
        t.requires_grad_()
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    if not split:
        loss(params, tokens, tokens, CFG).backward()
        return {k: t.grad for k, t in leaves.items()}
    pending = []
    with deferring_weight_grads(pending):
        out = loss(params, tokens, tokens, CFG)
    out.backward()  # the I pass
    assert leaves["blocks.0.qkv_w"].grad is None and leaves["blocks.0.ln_1_w"].grad is not None
    assert len(pending) == 4 * CFG.n_layer  # qkv, proj, fc, fc_proj per block
    apply_weight_grads(pending)  # the W pass
    return {k: t.grad for k, t in leaves.items()}


def test_input_then_weight_passes_equal_one_backward():
    plain, split = grads(False), grads(True)
    for k, g in plain.items():
        assert torch.allclose(split[k], g, rtol=1e-6, atol=1e-9), k
