"""Packed rows on a GPU: FlexAttention (compiled) with the block mask against SDPA with the boolean mask the CPU
uses, and a packed batch's loss and gradients against its documents one by one, for both families (fp32)."""
import pytest
import torch

from nanotrain.core.models import init_params, model_spec, preset, run
from nanotrain.core.models.documents import Documents, block_diagonal
from nanotrain.data.batches import IGNORE_INDEX
from nanotrain.core.tree import named_leaves, tree_map
from tests.conftest import rel_err
from tests.packed_cases import one_by_one, packed_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# FlexAttention's kernel sums keys in blocks of 64-128 and scales by exp2, where the boolean SDPA (or per document,
# flash) reduces otherwise: fp32 reorderings through two layers, with TF32 off; 1e-5 leaves room for the GPU's
# fused multiply-adds, ten times the CPU's bound.
GPU_TOL = 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, GPU_TOL), (torch.bfloat16, 2e-2)])
def test_flex_attention_equals_the_boolean_mask(dtype, tol):
    positions = torch.cat([torch.arange(n) for n in (300, 1000, 50, 698, 2048)]).view(2, 2048).cuda()
    docs = Documents.of(positions)
    assert docs.flex
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, 2048, 64, device="cuda", generator=g, dtype=dtype).requires_grad_() for h in (8, 2, 2))
    out = []
    for attend in (lambda: docs.attention(q, k, v),
                   lambda: torch.nn.functional.scaled_dot_product_attention(
                       q, k, v, attn_mask=block_diagonal(positions), enable_gqa=True)):
        y = attend()
        out.append((y, *torch.autograd.grad(y.float().square().sum(), (q, k, v))))
    for a, b in zip(*out):
        assert rel_err(a.float(), b.float()) < tol


@pytest.mark.parametrize("cfg", [preset("tiny", n_layer=2, vocab_size=128), preset("tiny-llama", n_layer=2)])
def test_packed_batch_on_the_gpu_equals_its_documents(cfg):
    spec = model_spec(cfg)
    batch = [t.cuda() for t in packed_batch(spec.vocab_size)]
    want_loss, want = one_by_one(spec, tree_map(lambda t: t.cuda(), init_params(spec, seed=1)), *batch)
    params = tree_map(lambda t: t.cuda().requires_grad_(), init_params(spec, seed=1))
    denom = int((batch[1] != IGNORE_INDEX).sum())
    loss = run.run_units(spec, params, batch[0], batch[1], denom=denom, positions=batch[2])
    loss.backward()
    assert abs(float(loss) - want_loss) <= GPU_TOL * want_loss
    for path, t in named_leaves(params):
        assert rel_err(t.grad, want[path]) < GPU_TOL, path
