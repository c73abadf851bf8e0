"""The Llama-class ops on the GPU paths (skipped without CUDA): rotary embeddings, grouped-query attention through
SDPA's GPU kernels, SwiGLU on the fused gate|up matrix and RMSNorm, eager and compiled by inductor, in bf16,
against the eager fp32 block on the same GPU (TF32 off).

Bound: bf16 keeps 8 bits of mantissa (unit roundoff u = 2^-8 = 3.9e-3). Each matmul's inputs are rounded
once and the kernels accumulate in fp32, so the block's output and gradients carry a few roundings of u each,
partly cancelling: 3e-2 (about 8 u) bounds them. The bugs these paths could hide (a rotation convention, a
key/value head paired with the wrong query group, a gate lost in a fused kernel) give errors of order 1.
"""
from __future__ import annotations

import pytest
import torch

from nanotrain.core.models import model_spec, preset, run
from nanotrain.core.tree import tree_map
from tests.conftest import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF16_TOL = 3e-2
VARIANTS = {"llama (GQA 6/2, untied)": {}, "qwen2 (q/k/v biases)": {"architecture": "qwen2"},
            "qwen3 (q/k norms, head_dim 12)": {"architecture": "qwen3", "head_dim": 12}}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS.keys())
def test_block_in_bf16_matches_fp32(overrides, compiled):
    torch.backends.cuda.matmul.allow_tf32 = False
    spec = model_spec(preset("tiny-llama", **overrides))
    params = run.init_params(spec, seed=0, device="cuda")
    p32 = params["blocks"][0]
    x32 = torch.randn(4, 96, spec.costs.width, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        p = {k: t.detach().to(dtype).requires_grad_() for k, t in p32.items()}
        x = x32.detach().to(dtype).requires_grad_()
        block = torch.compile(run.block, dynamic=False) if compiled and dtype == torch.bfloat16 else run.block
        y = block(spec, p, x)
        y.float().square().mean().backward()
        grads[dtype] = (y.float(), x.grad.float(), {k: t.grad.float() for k, t in p.items()})
    (y0, dx0, dp0), (y1, dx1, dp1) = grads[torch.float32], grads[torch.bfloat16]
    assert rel_err(y1, y0) < BF16_TOL, f"output {rel_err(y1, y0):.2e}"
    assert rel_err(dx1, dx0) < BF16_TOL, f"input gradient {rel_err(dx1, dx0):.2e}"
    for k in dp0:
        assert rel_err(dp1[k], dp0[k]) < BF16_TOL, f"grad of {k}: {rel_err(dp1[k], dp0[k]):.2e}"


def test_loss_in_bf16_matches_fp32_through_the_vocabulary():
    """The whole model, the chunked loss over the output matrix included, in bf16 against fp32."""
    spec = model_spec(preset("tiny-llama"))
    params = run.init_params(spec, seed=0, device="cuda")
    tokens = torch.randint(0, spec.vocab_size, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    l32 = run.loss(spec, params, tokens, tokens.roll(-1, 1))
    l16 = run.loss(spec, tree_map(lambda t: t.bfloat16(), params), tokens, tokens.roll(-1, 1))
    assert abs(l16.item() - l32.item()) / l32.item() < BF16_TOL
