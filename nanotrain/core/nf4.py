"""4-bit NormalFloat (NF4): a frozen base's weights as QLoRA and bitsandbytes store them (Dettmers et al. 2023).

A weight is cut into blocks of 64 elements; each block is divided by its largest magnitude (its absmax) and
every value is replaced by the index of the nearest of the 16 NF4 values: quantiles of a normal distribution
scaled into [-1, 1], with an exact 0 (bitsandbytes' published table, ``NF4``). Two indices share a byte, the
first in the high four bits (bitsandbytes' packing). The absmax values are double-quantised: their mean is
taken out and the rest stored in 8 bits, block-wise over blocks of 256 (``core.optim.quant8``'s signed dynamic
code and its absmax in fp32), so a weight costs 4 + 8/64 + 32/(64 x 256) = 4.127 bits.

A value is off by at most half the widest gap of the table (0.152) times its block's absmax, plus what the
8-bit scale loses (``error_bound``). Dequantising is a table lookup and a multiply, done on the device a
matrix at a time into the compute dtype. Plain torch: it runs on any device.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanotrain.core.kernels import fused
from nanotrain.core.optim.quant8 import dynamic_code, n_blocks, quantize_blockwise

# bitsandbytes' NF4 table (``bitsandbytes.functional.get_4bit_type("nf4")``), ascending
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])
MIDPOINTS = (NF4[1:] + NF4[:-1]) / 2  # a value above a midpoint rounds up; at it, down (as bitsandbytes decides)
BLOCK, SCALE_BLOCK = 64, 256
SCALE_VALUES = dynamic_code(True).values  # the scales' 8-bit code's 256 values, made once, outside any trace
CHUNK_BLOCKS = 1 << 16  # blocks quantised at once: 4M values
DEQUANT_BLOCKS = 1 << 18  # blocks dequantised at once: 16M values
DEQUANT_TEMP_BYTES = 16  # a value's int64 index, its fp32 table value and their fp32 product, alive at once


@dataclass
class NF4Tensor:
    """A quantised weight: packed codes, its blocks' absmax in 8 bits around their mean, and its shape."""
    codes: torch.Tensor         # uint8 [numel / 2]: two 4-bit indices per byte, the first in the high bits
    scales: torch.Tensor        # uint8 [blocks]: each block's absmax less ``offset``, 8-bit per SCALE_BLOCK
    scale_absmax: torch.Tensor  # fp32 [ceil(blocks / SCALE_BLOCK)]
    offset: torch.Tensor        # fp32 []: the mean absmax
    shape: torch.Size
    requires_grad = False       # a frozen base's weight: engines that ask which leaves train get no

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "NF4Tensor":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return NF4Tensor(move(self.codes), move(self.scales), move(self.scale_absmax), move(self.offset), self.shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)

    @property
    def parts(self) -> tuple[torch.Tensor, ...]:
        """The tensors that hold it (what travels)."""
        return self.codes, self.scales, self.scale_absmax, self.offset

    def empty_like(self) -> "NF4Tensor":
        """Buffers of the same sizes on the same device (a streaming slot's)."""
        return NF4Tensor(*(torch.empty_like(t) for t in self.parts), self.shape)

    def copy_(self, other: "NF4Tensor", non_blocking: bool = False) -> "NF4Tensor":
        for mine, theirs in zip(self.parts, other.parts):
            mine.copy_(theirs, non_blocking=non_blocking)
        return self

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + b`` of a frozen weight (``core.linear.linear`` calls this): dequantised into ``x``'s dtype for the
        matmul and again for its backward, so only the codes wait in between."""
        return _linear4(x, *self.parts, list(self.shape), bias)


# Two custom ops, opaque to torch.compile: traced inside a compiled block, a dequantised matrix was common to the
# forward and the backward, and the compiler kept it for the backward instead of the codes (an 8B model's whole
# base in bf16 beside the activations). Opaque, the backward can only dequantise again.
@torch.library.custom_op("nanotrain::nf4_linear", mutates_args=())
def _linear4(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, scale_absmax: torch.Tensor,
             offset: torch.Tensor, shape: list[int], bias: torch.Tensor | None) -> torch.Tensor:
    # The bias added after the matmul: ``F.linear`` with a bias returns a view of its 2-D product, and autograd
    # forbids an adapter's in-place add into a view made inside an opaque op (a q|k|v segment with biases, Qwen2's)
    y = F.linear(x, dequantize_nf4(NF4Tensor(codes, scales, scale_absmax, offset, torch.Size(shape)), x.dtype))
    return y if bias is None else y.add_(bias)


@torch.library.custom_op("nanotrain::nf4_linear_input_grad", mutates_args=())
def _input_grad4(g: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, scale_absmax: torch.Tensor,
                 offset: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return g @ dequantize_nf4(NF4Tensor(codes, scales, scale_absmax, offset, torch.Size(shape)), g.dtype)


@_linear4.register_fake
def _(x, codes, scales, scale_absmax, offset, shape, bias):  # noqa: ANN001, ANN202 (the op's own signature)
    return x.new_empty(*x.shape[:-1], shape[0])


@_input_grad4.register_fake
def _(g, codes, scales, scale_absmax, offset, shape):  # noqa: ANN001, ANN202
    return g.new_empty(*g.shape[:-1], shape[1])


def _keep_codes(ctx, inputs, output) -> None:  # noqa: ANN001
    x, *parts, shape, bias = inputs
    ctx.save_for_backward(*parts)
    ctx.shape, ctx.has_bias = shape, bias is not None


def _backward4(ctx, g: torch.Tensor) -> tuple:  # noqa: ANN001
    gx = _input_grad4(g, *ctx.saved_tensors, ctx.shape) if ctx.needs_input_grad[0] else None
    gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[6] else None
    return gx, None, None, None, None, None, gb


_linear4.register_autograd(_backward4, setup_context=_keep_codes)


def nf4_sizes(numel: int) -> list[tuple[int, torch.dtype]]:
    """(elements, dtype) of each of ``NF4Tensor.parts`` for a weight of ``numel`` elements, known before it is
    quantised (a host arena is carved for it first)."""
    blocks = n_blocks(numel, BLOCK)
    return [(blocks * BLOCK // 2, torch.uint8), (blocks, torch.uint8), (n_blocks(blocks, SCALE_BLOCK), torch.float32),
            (1, torch.float32)]


@functools.cache  # the planners ask it of every leaf of every plan they weigh
def nf4_bytes(numel: int) -> int:
    """The bytes of a weight of ``numel`` elements in NF4 (what the planners count)."""
    return sum(n * dtype.itemsize for n, dtype in nf4_sizes(numel))


def block_absmax(x: torch.Tensor) -> torch.Tensor:
    """Each block's largest magnitude (the smallest normal float for an all-zero block, which then decodes to 0)."""
    return x.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)


def quantize_nf4(w: torch.Tensor) -> NF4Tensor:
    """``w`` (any shape and float dtype, any device) in NF4; a ragged last block is padded with zeros. Blocks are
    independent, so ``CHUNK_BLOCKS`` are quantised at a time: the temporaries (fp32 values, their indices) are a
    chunk's, not the weight's several times over (a 70B model's fused MLP matrix is 470M elements)."""
    flat = w.detach().reshape(-1)
    blocks = n_blocks(flat.numel(), BLOCK)
    absmax = torch.empty(blocks, dtype=torch.float32, device=flat.device)
    codes = torch.empty(blocks * BLOCK // 2, dtype=torch.uint8, device=flat.device)
    midpoints = MIDPOINTS.to(flat.device)
    for lo in range(0, blocks, CHUNK_BLOCKS):
        hi = min(lo + CHUNK_BLOCKS, blocks)
        x = flat[lo * BLOCK:hi * BLOCK].float()
        x = F.pad(x, (0, (hi - lo) * BLOCK - x.numel())).view(hi - lo, BLOCK)
        absmax[lo:hi] = block_absmax(x)
        # multiplied by the reciprocal, as bitsandbytes' kernel does, then the nearest value by its midpoints
        index = torch.bucketize(x * (1.0 / absmax[lo:hi])[:, None], midpoints).to(torch.uint8).view(-1, 2)
        codes[lo * BLOCK // 2:hi * BLOCK // 2] = torch.bitwise_left_shift(index[:, 0], 4) | index[:, 1]
    offset = absmax.mean()
    scales, scale_absmax = quantize_blockwise(absmax - offset, dynamic_code(True, x.device), SCALE_BLOCK)
    return NF4Tensor(codes, scales, scale_absmax, offset, w.shape)


@functools.cache
def tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``NF4`` and ``SCALE_VALUES`` on ``device``, copied there once (a copy at each matmul made the host wait)."""
    return NF4.to(device), SCALE_VALUES.to(device)


def scales_of(scales: torch.Tensor, scale_absmax: torch.Tensor, offset: torch.Tensor,
              scale_values: torch.Tensor) -> torch.Tensor:
    """Each block's absmax as the 8-bit scales give it back: the code's value times its scale block's absmax, plus
    the offset (``quant8.dequantize_blockwise``'s arithmetic, as one expression the GPU's dequantisation fuses)."""
    return scale_values[scales.long()] * scale_absmax.repeat_interleave(SCALE_BLOCK)[:scales.numel()] + offset


def block_scales(t: NF4Tensor) -> torch.Tensor:
    """``t``'s blocks' absmax (``scales_of``)."""
    return scales_of(t.scales, t.scale_absmax, t.offset, tables(t.codes.device)[1])


def nf4_values(codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks' values in ``dtype`` from their packed ``codes`` and absmax ``scales``: each code's table entry
    times its block's absmax, in fp32, then cast."""
    index = torch.stack((torch.bitwise_right_shift(codes, 4), codes & 0x0F), dim=1).long()
    return (table[index].view(-1, BLOCK) * scales[:, None]).view(-1).to(dtype)


def dequantize_flat(codes: torch.Tensor, scales: torch.Tensor, scale_absmax: torch.Tensor, offset: torch.Tensor,
                    table: torch.Tensor, scale_values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every block's values from a weight's parts and the tables, flat (padding included): what a GPU compiles."""
    return nf4_values(codes, scales_of(scales, scale_absmax, offset, scale_values), table, dtype)


def dequantize_nf4(t: NF4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight in ``dtype``, on the codes' device. Compiled on a GPU (``core.kernels.fused``): one pass that
    reads the codes and scales and writes the result. Eager, ``DEQUANT_BLOCKS`` at a time, so the temporaries
    (int64 indices, fp32 values: ``DEQUANT_TEMP_BYTES`` a value) are a chunk's: whole, a 70B model's fused MLP
    matrix would take 8 GiB of them beside its 0.9 GiB result."""
    table, scale_values = tables(t.codes.device)
    whole = fused(dequantize_flat, t.codes.device)
    if whole is not dequantize_flat:
        return whole(*t.parts, table, scale_values, dtype)[:t.shape.numel()].view(t.shape)
    scales = scales_of(t.scales, t.scale_absmax, t.offset, scale_values)
    out = torch.empty(scales.numel() * BLOCK, dtype=dtype, device=t.codes.device)
    for lo in range(0, scales.numel(), DEQUANT_BLOCKS):
        hi = min(lo + DEQUANT_BLOCKS, scales.numel())
        out[lo * BLOCK:hi * BLOCK] = nf4_values(t.codes[lo * BLOCK // 2:hi * BLOCK // 2], scales[lo:hi], table, dtype)
    return out[:t.shape.numel()].view(t.shape)


def dequant_bytes(numel: int, dtype_bytes: int) -> int:
    """GPU bytes while a weight of ``numel`` elements is dequantised: its result and one chunk's temporaries."""
    return numel * dtype_bytes + min(numel, DEQUANT_BLOCKS * BLOCK) * DEQUANT_TEMP_BYTES


def error_bound(t: NF4Tensor) -> torch.Tensor:
    """Per block, the largest error a value of it may have: half the widest gap of the table times the stored
    absmax, plus the stored absmax's own error (half the widest gap of the 8-bit code times its block's scale)."""
    half_gap = float((NF4[1:] - NF4[:-1]).max()) / 2
    code = dynamic_code(True, t.scales.device)
    scale_err = (code.max_gap / 2) * t.scale_absmax.repeat_interleave(SCALE_BLOCK)[:t.scales.numel()]
    return half_gap * (block_scales(t) + scale_err) + scale_err
