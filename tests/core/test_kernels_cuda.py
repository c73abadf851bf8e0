"""The kernels compiled on GPUs (``nanotrain.core.kernels.fused``) against the eager expressions the CPU runs."""
import pytest
import torch

from nanotrain.core import loss as L
from nanotrain.data.batches import IGNORE_INDEX
from nanotrain.core.optim.quant8 import dequantize_blockwise, dynamic_code, quantize_blockwise, quantize_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_compiled_cross_entropy_matches_eager(monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(5000, 256, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(50257, 256, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, 50257, (5000,), device="cuda", generator=g)
    t[::7] = IGNORE_INDEX
    out = []
    for eager in (False, True):
        if eager:
            monkeypatch.setattr(L, "fused", lambda fn, device: fn)
        h.grad = w.grad = None
        loss = L.chunked_cross_entropy(h, w, t)
        loss.backward()
        out.append((loss.float(), h.grad.float(), w.grad.float()))
    for a, b in zip(*out):
        assert float((a - b).abs().max()) <= 2e-3 * float(b.abs().max())


def test_compiled_quantize_matches_eager():
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 1 << 20
    x = torch.randn(n, device="cuda", generator=g) * torch.logspace(-9, 1, n, device="cuda")
    for signed in (True, False):
        code = dynamic_code(signed, torch.device("cuda"))
        xi = x if signed else x.abs()
        q0, a0 = quantize_rows(xi.view(-1, 2048), code.below, code.bin_mid, signed, 128)  # eager
        q1, a1 = quantize_blockwise(xi.clone(), code, 2048)                                # compiled
        assert torch.equal(a0, a1)
        assert int((q0 != q1).sum()) <= n // 100_000  # division rounding may move a value across a midpoint
        back = dequantize_blockwise(q1, a1, code, 2048)
        assert float(((back - xi).abs() / a1.repeat_interleave(2048)).max()) < code.max_gap
