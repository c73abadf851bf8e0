"""NF4 (``core.nf4``): the table is bitsandbytes', rebuilt here from its definition; codes equal the reference
algorithm's (the nearest table value of each value over its block's absmax, a tie going down, two per byte with
the first in the high bits); dequantised values within the published bound; the bytes the planners count."""
import pytest
import torch

from nanotrain.core.nf4 import (BLOCK, NF4, dequantize_nf4, error_bound, nf4_bytes, quantize_nf4)


def test_the_table_is_bitsandbytes_normal_quantiles():
    """bitsandbytes' ``create_normal_map(0.9677083, use_extra_value=True)``: 8 positive and 7 negative quantiles of
    N(0, 1) between the 0.9677083 one and the median, 0, scaled by the largest. bitsandbytes rounds the quantiles to
    fp32 and divides in fp32 (two roundings of half an ulp, an ulp of [0.5, 1) being 2^-24); rebuilt here in
    float64, the table agrees within 2^-23."""
    offset = 0.9677083
    ndtri = lambda p: torch.special.ndtri(torch.tensor(p, dtype=torch.float64))  # noqa: E731
    pos = ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1].tolist())
    neg = -ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1].tolist())
    values = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    values /= values.abs().max()
    assert (values - NF4.double()).abs().max() <= 2 ** -23
    assert NF4[7] == 0 and NF4[0] == -1 and NF4[-1] == 1


def reference_codes(x: torch.Tensor) -> torch.Tensor:
    """The reference algorithm, elementwise: nearest table value (lowest index on a tie) of x / block absmax."""
    blocks = x.view(-1, BLOCK)
    y = blocks * (1.0 / blocks.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny))
    return (y.view(-1, 1) - NF4).abs().argmin(dim=1)  # argmin takes the first of equal distances


@pytest.mark.parametrize("shape", [(96, 64), (3, 100), (1, 2)])
def test_codes_equal_the_reference_and_pack_two_a_byte(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * 0.02
    w.view(-1)[min(5, w.numel() - 1)] = 0.5  # an outlier: its block's absmax
    t = quantize_nf4(w)
    n = w.numel()
    padded = torch.nn.functional.pad(w.reshape(-1), (0, -n % BLOCK))
    ref = reference_codes(padded)
    assert torch.equal(torch.bitwise_right_shift(t.codes, 4).long(), ref[0::2])
    assert torch.equal((t.codes & 0x0F).long(), ref[1::2])
    assert t.codes.numel() == padded.numel() // 2 and t.nbytes == nf4_bytes(n)


def test_midpoint_ties_go_down_and_the_extremes_are_exact():
    """Values exactly between two table values take the lower one (bitsandbytes' ``x > threshold`` tests); +-absmax
    and 0 are in the table, so they come back exactly (the scale's own 8-bit error aside: one block here)."""
    mids = ((NF4[1:] + NF4[:-1]) / 2).tolist()
    w = torch.tensor(mids + [1.0, -1.0, 0.0] + [0.0] * (BLOCK - len(mids) - 3))
    t = quantize_nf4(w)
    codes = torch.stack((torch.bitwise_right_shift(t.codes, 4), t.codes & 0x0F), 1).view(-1).long()
    assert codes[:15].tolist() == list(range(15))
    assert codes[15:18].tolist() == [15, 0, 7]


@pytest.mark.parametrize("dist", ["normal", "heavy-tailed", "blocks-of-zeros"])
def test_dequantised_error_is_within_the_published_bound(dist):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(512, 384, generator=g) * 0.02
    if dist == "heavy-tailed":
        w = w * torch.rand(512, 384, generator=g).pow(-2).clamp_max(1e4)  # absmax varying over 6 decades
    if dist == "blocks-of-zeros":
        w[:, :128] = 0
    t = quantize_nf4(w)
    back = dequantize_nf4(t, torch.float32)
    err = (back - w).abs().view(-1, BLOCK).amax(dim=1)
    bound = error_bound(t) * (1 + 1e-6)  # fp32 rounding of the multiply and the scale's sum
    assert bool((err <= bound).all()), float((err / bound).max())
    assert not back.view(-1, BLOCK)[w.view(-1, BLOCK).abs().amax(1) == 0].any()  # 0 is in the table: zeros stay
    rel = ((back - w).norm() / w.norm()).item()
    assert rel < 0.12  # NF4 keeps ~3.5 bits of a normal weight: about 10% relative error in the norm
    assert dequantize_nf4(t, torch.bfloat16).dtype == torch.bfloat16


def test_dequantised_in_chunks_equals_one_pass(monkeypatch):
    """Chunks (a ragged last one, a padded last block) give the values of one pass over the whole weight, bit for bit:
    each value is its table entry times its block's absmax, whatever chunk it falls in."""
    import nanotrain.core.nf4 as nf4
    w = torch.randn(7, 300, generator=torch.Generator().manual_seed(2))  # 2,100 values: 33 blocks, the last padded
    t = quantize_nf4(w)
    whole = dequantize_nf4(t, torch.float32)
    monkeypatch.setattr(nf4, "DEQUANT_BLOCKS", 4)  # 9 chunks, the last of one block
    assert torch.equal(dequantize_nf4(t, torch.float32), whole)
    assert torch.equal(dequantize_nf4(t, torch.bfloat16), whole.to(torch.bfloat16))
    assert nf4.dequant_bytes(2100, 2) == 2100 * 2 + 4 * BLOCK * nf4.DEQUANT_TEMP_BYTES
    # what a GPU runs: the values compiled into one pass over the whole weight (inductor on the CPU here)
    compiled = torch.compile(nf4.dequantize_flat, dynamic=False)
    assert torch.equal(compiled(*t.parts, *nf4.tables(t.codes.device), torch.bfloat16)[:2100].view(7, 300),
                       whole.to(torch.bfloat16))


def test_a_4bit_matmul_traces_as_one_graph_with_the_scales_of_the_8bit_code():
    """Inside a compiled block a 4-bit matmul (forward and backward) is traced whole: ``fullgraph`` raises at a graph
    break (building the scales' 8-bit code there broke it at every matmul: a compiled QLoRA block ran in pieces).
    The scales it dequantises with are ``quant8.dequantize_blockwise``'s, bit for bit."""
    from nanotrain.core.nf4 import SCALE_BLOCK, block_scales
    from nanotrain.core.optim.quant8 import dequantize_blockwise, dynamic_code
    g = torch.Generator().manual_seed(3)
    t = quantize_nf4(torch.randn(48, 600, generator=g))  # 450 blocks: two scale blocks, the last ragged
    reference = dequantize_blockwise(t.scales, t.scale_absmax, dynamic_code(True), SCALE_BLOCK) + t.offset
    assert torch.equal(block_scales(t), reference)
    loss = lambda x: t.linear(x, None).square().sum()  # noqa: E731
    x, eager = (torch.randn(2, 5, 600, generator=g).requires_grad_() for _ in range(2))
    eager.data.copy_(x.data)
    torch.compile(loss, fullgraph=True, backend="eager")(x).backward()
    loss(eager).backward()
    assert torch.equal(x.grad, eager.grad)  # the same ops, traced: the same bits


def test_a_compiled_4bit_matmul_keeps_the_codes_for_its_backward_not_the_matrix():
    """What a compiled block saves for its backward, under the partitioner inductor uses (min-cut, here without
    code generation): the codes and scales and the activations, never the dequantised matrix (it did: a compiled
    8B QLoRA step without recompute kept the whole base in bf16 and ran out of a 24 GiB GPU). The gradients equal
    eager's, bit for bit (the same ops)."""
    g = torch.Generator().manual_seed(4)
    t = quantize_nf4(torch.randn(96, 64, generator=g))
    bias = torch.randn(96, generator=g, requires_grad=True)
    loss = lambda x: torch.relu(t.linear(x, bias)).sum()  # noqa: E731
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager_decomp_partition")
    x = torch.randn(3, 64, generator=g, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        compiled(x).backward()
    assert all(s.numel() < 96 * 64 for s in saved), [tuple(s.shape) for s in saved]
    assert any(s.dtype == torch.uint8 and s.numel() == 96 * 64 // 2 for s in saved)  # the codes, packed two a byte
    grads = x.grad, bias.grad
    x.grad = bias.grad = None
    loss(x).backward()
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], bias.grad)


def test_table_and_codes_equal_bitsandbytes_where_it_is_installed():
    """The reference itself (bitsandbytes' CPU kernels), where installed: its table, and its packed codes byte for
    byte. (Its 8-bit code for the double-quantised scales is its own dynamic map; ours is ``core.optim.quant8``'s,
    so the scales' bytes differ, within the bound above.)"""
    bnb = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is not installed (optional reference)")
    assert torch.equal(bnb.get_4bit_type("nf4", device="cpu"), NF4)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(256, 192, generator=g) * 0.02
    w[3, 7] = 0.3
    packed, _ = bnb.quantize_4bit(w, blocksize=BLOCK, quant_type="nf4", compress_statistics=True)
    assert torch.equal(packed.view(-1), quantize_nf4(w).codes)
