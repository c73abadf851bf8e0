"""Block-wise 8-bit quantization with the dynamic tree code: the code, the search, the error bound."""
import pytest
import torch

from nanotrain.core.optim.quant8 import Code, dequantize_blockwise, dynamic_code, quantize_blockwise
from tests.conftest import U32

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def per_element_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    pad = -x.numel() % block
    blocks = torch.cat([x, x.new_zeros(pad)]).view(-1, block)
    return blocks.abs().amax(1).repeat_interleave(block)[:x.numel()]


def nearest_by_bucketize(x: torch.Tensor, code: Code, block: int) -> torch.Tensor:
    """The reference answer: index of the nearest code value (ties to the smaller magnitude)."""
    y = x / per_element_absmax(x, block).clamp_min(torch.finfo(torch.float32).tiny)
    half = 128 if code.signed else 0
    mags = code.values[half:]
    j = torch.bucketize(y.abs() if code.signed else y, (mags[1:] + mags[:-1]) / 2)
    return (torch.where(torch.signbit(y), 127 - j, 128 + j) if code.signed else j).to(torch.uint8)


def sample(signed: bool, n: int, device: str) -> torch.Tensor:
    x = torch.randn(n, device=device) * torch.logspace(-4, 1, n, device=device)[torch.randperm(n, device=device)]
    return x if signed else x * x


def test_codes_have_256_sorted_values_with_zero_and_unit_ends():
    for signed in (True, False):
        v = dynamic_code(signed).values
        assert v.numel() == 256 and bool((v[1:] >= v[:-1]).all())
        assert v[-1] == 1 and (0 in v.tolist())
    s, u = dynamic_code(True).values, dynamic_code(False).values
    assert torch.equal(s, -s.flip(0)), "the signed code is symmetric, so -absmax round-trips too"
    assert s[0] == -1 and s[127] == 0 and s[128] == 0  # zero twice: the +0 and -0 patterns
    assert u[0] == 0 and bool((u[1:] > u[:-1]).all())
    # Tree structure: the top decade holds half the magnitudes, each lower decade half of the rest.
    assert int(((s > 0.1) & (s <= 1)).sum()) == 64 and int(((s > 0.01) & (s <= 0.1)).sum()) == 32
    assert int(((u > 0.1) & (u <= 1)).sum()) == 128 and u[1] == pytest.approx(1e-7)
    assert s[129] == pytest.approx(1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n,block", [(10_000, 2048), (4096, 2048), (777, 256), (5, 2048)])
def test_lookup_table_search_equals_bucketize(device, signed, n, block):
    code = dynamic_code(signed, device)
    x = sample(signed, n, device)
    x[: n // 10] = 0.0
    q, absmax = quantize_blockwise(x, code, block)
    assert q.dtype == torch.uint8 and absmax.numel() == -(-n // block)
    assert torch.equal(q, nearest_by_bucketize(x, code, block).to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("signed", [True, False])
def test_round_trip_error_is_at_most_half_the_widest_code_gap_times_absmax(device, signed):
    code, block = dynamic_code(signed, device), 2048
    x = sample(signed, 3 * block + 123, device)  # a ragged last block
    q, absmax = quantize_blockwise(x, code, block)
    back = dequantize_blockwise(q, absmax, code, block)
    # Bound: |x - x'| <= absmax * max_gap / 2 (max_gap: 0.9/64 signed, 0.9/128 unsigned), plus a few
    # fp32 roundings of the division by absmax and the multiplication back (3e-7 relative to absmax).
    bound = per_element_absmax(x, block) * (code.max_gap / 2 + 3e-7)
    assert bool(((x - back).abs() <= bound).all())
    # the widest gap, 0.9/n in the top decade: each value (at most 1) computed in float64 (a product and a sum: a few
    # of its ulps) and rounded to fp32 once (U32 at most), the difference of neighbours exact (Sterbenz)
    assert code.max_gap == pytest.approx(0.9 / (64 if signed else 128), rel=0,
                                         abs=2 * U32 + 8 * torch.finfo(torch.float64).eps)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_absmax_and_sign_are_exact(device):
    code, block = dynamic_code(True, device), 256
    x = torch.randn(5 * block + 17, device=device)
    x[:block] = 0.0                      # a whole block of zeros
    x[block + 3 :: 7] = 0.0              # scattered zeros
    x[2 * block + 5] = -50.0             # a negative absmax
    x[3 * block + 9] = 50.0              # a positive absmax
    back = dequantize_blockwise(*quantize_blockwise(x, code, block), code, block)
    zeros = x == 0
    assert bool((back[zeros] == 0).all())
    assert back[2 * block + 5] == -50.0 and back[3 * block + 9] == 50.0
    ends = per_element_absmax(x, block) == x.abs()
    assert torch.equal(back[ends], x[ends]), "every block's largest magnitude round-trips exactly"
    assert bool((torch.sign(back) * torch.sign(x) >= 0).all()), "no value changes sign"
    assert bool((back[~zeros] != 0).sum() > 0.99 * int((~zeros).sum()))


def test_unsigned_code_saturates_negative_inputs_to_zero():
    code = dynamic_code(False)
    x = torch.tensor([-1.0, 0.5, 2.0])
    back = dequantize_blockwise(*quantize_blockwise(x, code, 4), code, 4)
    assert back[0] == 0 and back[2] == 2.0


def test_dynamic_code_beats_linear_on_small_magnitudes():
    """On N(0, 1) data the dynamic code keeps small values that linear 8-bit rounds to coarse steps."""
    block = 2048
    x = torch.randn(64 * block)
    linear = Code.from_magnitudes(torch.linspace(0, 1, 128), signed=True)  # absmax int8: round(127 x) / 127
    rel = {}
    for name, code in (("dynamic", dynamic_code(True)), ("linear", linear)):
        back = dequantize_blockwise(*quantize_blockwise(x, code, block), code, block)
        rel[name] = ((back - x).abs() / x.abs()).clamp_max(1.0)
    small = x.abs() < 0.1 * per_element_absmax(x, block)  # ~20% of a normal sample
    assert rel["dynamic"][small].mean() < 0.25 * rel["linear"][small].mean()
    assert rel["dynamic"].mean() < rel["linear"].mean()


def test_errors_name_the_bad_input():
    code = dynamic_code(True)
    with pytest.raises(ValueError, match="flat fp32"):
        quantize_blockwise(torch.zeros(4, 4), code, 2)
    with pytest.raises(ValueError, match="absmax"):
        dequantize_blockwise(torch.zeros(10, dtype=torch.uint8), torch.ones(1), code, 4)
    with pytest.raises(ValueError, match="128 strictly ascending"):
        Code.from_magnitudes(torch.linspace(0, 1, 100), signed=True)


def test_rows_expressions_equal_the_in_place_path():
    """quantize_rows / dequantize_rows (compiled on GPUs by kernels.fused) give the same codes,
    scales and values as the in-place path the CPU runs."""
    from nanotrain.core.optim.quant8 import dequantize_rows, quantize_rows
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 256, generator=g) * torch.logspace(-9, 1, 64 * 256)[torch.randperm(64 * 256, generator=g)]
    x[:256] = 0.0
    for signed in (True, False):
        code = dynamic_code(signed)
        xi = x if signed else x.abs()
        q0, a0 = quantize_blockwise(xi.clone(), code, 256)
        q1, a1 = quantize_rows(xi.view(-1, 256), code.below, code.bin_mid, signed, code.values.numel() // 2)
        assert torch.equal(q0, q1) and torch.equal(a0, a1)
        assert torch.equal(dequantize_rows(q1.view(-1, 256), a1, code.values), dequantize_blockwise(q0, a0, code, 256))
