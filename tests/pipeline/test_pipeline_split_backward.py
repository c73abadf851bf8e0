"""The I + W split of backward gives autograd's gradients, and W really is deferred."""
from __future__ import annotations

import torch

from nanotrain.core.models import init_params, loss, model_spec, preset
from nanotrain.core.linear import apply_weight_grads, deferring_weight_grads
from nanotrain.core.tree import named_leaves
from tests.conftest import chain_rtol, model_chain, rel_err
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
    spec = model_spec(CFG)
    blocks = [path for unit in spec.block_units for path in unit.paths]
    matrices = [path for path in blocks if len(spec.leaf(path).shape) == 2]  # the blocks' matmul weights
    assert all(leaves[p].grad is None for p in matrices) and all(leaves[p].grad is not None for p in blocks
                                                                   if p not in matrices)
    assert len(pending) == len(matrices)  # one deferred weight gradient per matmul
    apply_weight_grads(pending)  # the W pass
    return {k: t.grad for k, t in leaves.items()}


def test_input_then_weight_passes_equal_one_backward():
    plain, split = grads(False), grads(True)
    for k, g in plain.items():  # the same matmuls in two passes: at most the model's chain (conftest.chain_rtol)
        assert rel_err(split[k], g) <= chain_rtol(model_chain(CFG, 16, 32)), k
