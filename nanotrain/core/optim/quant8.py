"""Block-wise 8-bit quantization with the dynamic tree code (Dettmers et al. 2021).

A tensor is cut into blocks of ``block`` elements; each block is divided by its largest magnitude
(``absmax``, kept in fp32) and every normalised value is replaced by the index of the nearest of
256 code values. Normalising per block keeps an outlier from spoiling the whole tensor; the code's
non-linear spacing keeps small values: Adam's moments span many orders of magnitude.

The dynamic tree code reads a byte as: a sign bit (signed code only), then ``e`` zero bits giving
the decimal exponent, then a 1 bit ending the exponent, then linear fraction bits. Values with
``e`` leading zeros lie in the decade (10^-(e+1), 10^-e] on a uniform grid of 2^f points,
``10^-e * (0.1 + 0.9 k / 2^f)`` for k = 1..2^f with f the remaining fraction bits, so the top decade
gets the finest grid and every extra zero trades one bit of precision for a decade of range. The
all-zero pattern is 0. This gives

* unsigned (second moment, >= 0): 8 magnitude bits, decades e = 0..7, 128 + 64 + ... + 1 = 255
  values down to 1e-7, plus 0: 256 distinct values;
* signed (first moment): a sign and 7 magnitude bits, decades e = 0..6, 64 + ... + 1 = 127 values
  down to 1e-6, plus 0, mirrored: 256 values with 0 twice (the +0 and -0 patterns).

Unlike bitsandbytes, which takes the midpoint of each grid cell and so cannot represent -1, each
decade here ends on its upper edge, so +-1 are in the code: a block's absmax round-trips exactly
whatever its sign, and the code is exactly symmetric.

Quantizing is a nearest-value search. ``torch.bucketize`` against the 255 midpoints does it but
costs ~60 ns per element on a CPU core, far more than the Adam update itself, so ``Code`` keeps a
lookup table indexed by the top 16 bits of a float's pattern (sign, exponent, 7 mantissa bits).
Non-negative floats order like their bit patterns, so each table bin is an interval; the code is
built so that no bin holds more than one midpoint, which makes ``below[bin] + (x > bin_mid[bin])``
exactly the bucketize answer for a few cheap passes. All of it is plain torch and runs on any
device.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from nanotrain.core.kernels import fused
from nanotrain.core.optim.scratch import Scratch
_TOP_BITS_OF_ONE = 0x3F80  # the top 16 bits of 1.0f: bins 0..0x3F80 cover every float in [0, 1]


@dataclass(frozen=True)
class Code:
    """256 sorted code values plus the lookup tables that find the nearest one quickly."""

    values: torch.Tensor  # [256] fp32, ascending; byte q decodes to values[q]
    signed: bool
    below: torch.Tensor   # int32 [0x3F81]: how many magnitude midpoints lie below the start of each bin
    bin_mid: torch.Tensor  # fp32 [0x3F81]: the first midpoint at or above the start of each bin

    @staticmethod
    def from_magnitudes(magnitudes: torch.Tensor, signed: bool) -> Code:
        """Build a code from its ascending magnitudes, 0 first and 1 last.

        A signed code mirrors 128 magnitudes (0 appears twice); an unsigned code uses 256.
        """
        mags = magnitudes.to(torch.float32).cpu()
        want = 128 if signed else 256
        if mags.numel() != want or mags[0] != 0 or mags[-1] != 1 or not bool((mags[1:] > mags[:-1]).all()):
            raise ValueError(f"a {'signed' if signed else 'unsigned'} code needs {want} strictly ascending "
                             f"magnitudes from 0 to 1, got {mags.numel()} values from {mags[0]} to {mags[-1]}")
        values = torch.cat([-mags.flip(0)[:-1], torch.zeros(2), mags[1:]]) if signed else mags
        mids = (mags[1:] + mags[:-1]) / 2
        mid_bins = mids.view(torch.int32) >> 16
        if not bool((mid_bins[1:] > mid_bins[:-1]).all()):
            raise ValueError("two code midpoints share a 16-bit lookup bin; the code is too fine for the table")
        bin_starts = (torch.arange(_TOP_BITS_OF_ONE + 1, dtype=torch.int32) << 16).view(torch.float32)
        below = torch.searchsorted(mids, bin_starts, out_int32=True)
        bin_mid = torch.cat([mids, torch.tensor([float("inf")])])[below.long()]
        return Code(values, signed, below, bin_mid)

    def to(self, device: torch.device | str) -> Code:
        return Code(self.values.to(device), self.signed, self.below.to(device), self.bin_mid.to(device))

    @property
    def max_gap(self) -> float:
        """The widest gap between neighbouring values: the round-trip error is at most half of it."""
        return float((self.values[1:] - self.values[:-1]).max())


def dynamic_magnitudes(magnitude_bits: int) -> torch.Tensor:
    """0 then the dynamic tree code's positive values, ascending (2^magnitude_bits in all)."""
    mags = [0.0]
    for e in reversed(range(magnitude_bits)):  # smallest decade first
        n = 2 ** (magnitude_bits - 1 - e)      # fraction bits left after e zeros and the indicator
        mags += [10.0 ** -e * (0.1 + 0.9 * k / n) for k in range(1, n + 1)]
    return torch.tensor(mags, dtype=torch.float64).to(torch.float32)


@functools.lru_cache(maxsize=None)
def dynamic_code(signed: bool, device: torch.device | str = "cpu") -> Code:
    """The signed (first moment) or unsigned (second moment) dynamic tree code, on ``device``."""
    return Code.from_magnitudes(dynamic_magnitudes(7 if signed else 8), signed).to(device)


def _blocks(x: torch.Tensor, block: int) -> list[tuple[torch.Tensor, slice]]:
    """``x`` (flat) as [n_blocks, block] views, the ragged tail as its own [1, rest] view."""
    full = x.numel() // block * block
    parts = [(x[:full].view(-1, block), slice(0, full // block))] if full else []
    if full < x.numel():
        parts.append((x[full:].view(1, -1), slice(full // block, full // block + 1)))
    return parts


def n_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def quantize_rows(x: torch.Tensor, below: torch.Tensor, bin_mid: torch.Tensor, signed: bool,
                  half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_blockwise`` of whole blocks ``x`` [rows, block] as one expression (for ``kernels.fused``).

    The same ops as the in-place path below, which keeps its temporaries in a scratch pool instead;
    compiled, the ~15 passes over int32/int64 temporaries become two kernels (a 1.5B-parameter
    8-bit step spent a tenth of its GPU time here).
    """
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    y = x / scale
    mag = y.abs() if signed else y.clamp_min(0)
    mbits = mag.view(torch.int32)
    bins = torch.bitwise_right_shift(mbits, 16).clamp(0, _TOP_BITS_OF_ONE).long()
    above = torch.bitwise_right_shift(bin_mid[bins].view(torch.int32) - mbits, 31)
    j = below[bins] - above
    if signed:
        j = torch.bitwise_xor(j, torch.bitwise_right_shift(y.view(torch.int32), 31)) + half
    return j.to(torch.uint8).view(-1), scale.view(-1)


def dequantize_rows(q: torch.Tensor, absmax: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``dequantize_blockwise`` of whole blocks ``q`` [rows, block] as one expression."""
    return (values[q.long()] * absmax[:, None]).view(-1)


def quantize_blockwise(x: torch.Tensor, code: Code, block: int,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None,
                       scratch: Scratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize flat fp32 ``x`` to (uint8 codes, fp32 absmax per block); any length.

    An unsigned code saturates negative inputs to 0. ``out`` reuses existing (codes, absmax);
    ``scratch`` holds the temporaries (see scratch.py).
    """
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"quantize_blockwise wants a flat fp32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    n, dev, s = x.numel(), x.device, scratch or Scratch()
    q, absmax = out if out is not None else (torch.empty(n, dtype=torch.uint8, device=dev),
                                             torch.empty(n_blocks(n, block), dtype=torch.float32, device=dev))
    full = n // block * block
    if dev.type == "cuda" and full:  # whole blocks by one compiled kernel, a ragged tail as below
        qf, af = fused(quantize_rows, dev)(x[:full].view(-1, block), code.below, code.bin_mid, code.signed,
                                           code.values.numel() // 2)
        q[:full].copy_(qf)
        absmax[:full // block].copy_(af)
        if full < n:
            quantize_blockwise(x[full:], code, block, (q[full:], absmax[full // block:]), s)
        return q, absmax
    y = s.get("y", n, torch.float32, dev)
    for (xb, rows), (yb, _) in zip(_blocks(x, block), _blocks(y, block)):
        # An all-zero block gets the smallest normal float as scale, so 0/scale = 0 decodes to 0.
        scale = torch.amax(torch.abs(xb, out=yb), dim=1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
        absmax[rows] = scale.view(-1)
        torch.div(xb, scale, out=yb)  # true division keeps |y| <= 1, and absmax / absmax == 1 exactly
    bits = y.view(torch.int32)
    sign = torch.bitwise_right_shift(bits, 31, out=s.get("sign", n, torch.int32, dev)) if code.signed else None
    mag = y.abs_() if code.signed else y.clamp_min_(0)  # sign is -1 (all ones) for negatives, else 0
    j = torch.bitwise_right_shift(bits, 16, out=s.get("j", n, torch.int32, dev))
    bins = s.get("bins", n, torch.int64, dev).copy_(j.clamp_(0, _TOP_BITS_OF_ONE))  # NaN saturates, not overflows
    # take, not index_select: on CPU, index_select of a 1-D tensor is one serial loop.
    torch.take(code.below, bins, out=j)
    mid = torch.take(code.bin_mid, bins, out=s.get("mid", n, torch.float32, dev))
    # mag > mid, compared as bit patterns (both >= 0): the sign of mid - mag is -1 exactly then.
    above = torch.sub(mid.view(torch.int32), mag.view(torch.int32), out=mid.view(torch.int32)).bitwise_right_shift_(31)
    j.sub_(above)
    if sign is not None:
        # Magnitude j sits at 128 + j and its negative at 127 - j = 128 + ~j; j ^ -1 == ~j.
        j.bitwise_xor_(sign).add_(code.values.numel() // 2)
    q.copy_(j)
    return q, absmax


def dequantize_blockwise(q: torch.Tensor, absmax: torch.Tensor, code: Code, block: int,
                         out: torch.Tensor | None = None, scratch: Scratch | None = None) -> torch.Tensor:
    """Flat fp32 values of uint8 codes ``q``: ``code.values[q]`` times the block's absmax."""
    if q.dim() != 1 or q.dtype != torch.uint8:
        raise ValueError(f"dequantize_blockwise wants flat uint8 codes, got {q.dtype} of shape {tuple(q.shape)}")
    if absmax.numel() != n_blocks(q.numel(), block):
        raise ValueError(f"{q.numel()} codes in blocks of {block} need {n_blocks(q.numel(), block)} absmax values, "
                         f"got {absmax.numel()}")
    out = torch.empty(q.numel(), dtype=torch.float32, device=q.device) if out is None else out
    full = q.numel() // block * block
    if q.device.type == "cuda" and full:
        out[:full].copy_(fused(dequantize_rows, q.device)(q[:full].view(-1, block), absmax[:full // block],
                                                           code.values))
        if full < q.numel():
            dequantize_blockwise(q[full:], absmax[full // block:], code, block, out[full:], scratch)
        return out
    index = (scratch or Scratch()).get("bins", q.numel(), torch.int64, q.device).copy_(q)
    torch.take(code.values, index, out=out)
    for ob, rows in _blocks(out, block):
        ob.mul_(absmax[rows].view(-1, 1))
    return out
