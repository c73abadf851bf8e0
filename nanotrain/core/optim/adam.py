"""AdamW on flat fp32 tensors, with moments kept in 32 bits or block-wise 8 bits.

``adam_step`` walks the tensor in chunks of about a million elements: each op of a chunk (widen
the gradient, dequantize the moments, update, requantize, cast the new weights for the device) is
spread over torch's intra-op threads and finds its operands still in the L2/L3 caches, the chunk
is long enough to pay for waking those threads, and the 8-bit path never holds more than one chunk
of moments in fp32. On a 16-core host, chunks of 2^18 or 2^22 elements were slower. The update
itself is torch's fused AdamW kernel where the device has one (CPU and CUDA in current torch),
else the same arithmetic as ``torch.optim.AdamW`` (single-tensor path) written with in-place ops.

Weight decay is decoupled, as in ``torch.optim.AdamW``; with ``weight_decay=0`` this is Adam.
L2-coupled decay (``torch.optim.Adam(weight_decay=...)``) is not offered.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from nanotrain.core.kernels import fused
from nanotrain.core.optim.fused8 import FUSED_CHUNK, adamw8_rows, rows_args, step_scalars
from nanotrain.core.optim.quant8 import dequantize_blockwise, dynamic_code, n_blocks, quantize_blockwise
from nanotrain.core.optim.scratch import Scratch
CPU_CHUNK = 1 << 20   # elements: 4 MB per fp32 operand; fastest on a 16-core host (bench.py --chunk)
CUDA_CHUNK = 1 << 22  # large enough that kernel launches do not dominate, small enough to spare memory


@dataclass(frozen=True)
class AdamConfig:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not self.lr >= 0:
            raise ValueError(f"lr={self.lr} must be >= 0")
        if not all(0 <= b < 1 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"betas={self.betas} must be two numbers in [0, 1)")
        if not self.eps > 0:
            raise ValueError(f"eps={self.eps} must be > 0")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be >= 0")


@dataclass
class AdamState32:
    exp_avg: torch.Tensor     # flat fp32, like the parameter
    exp_avg_sq: torch.Tensor


@dataclass
class AdamState8:
    exp_avg: torch.Tensor            # flat uint8, signed dynamic code
    exp_avg_absmax: torch.Tensor     # fp32, one per block
    exp_avg_sq: torch.Tensor         # flat uint8, unsigned dynamic code
    exp_avg_sq_absmax: torch.Tensor
    block: int


AdamState = AdamState32 | AdamState8


def init_state(p: torch.Tensor, bits: int = 32, block: int = 2048) -> AdamState:
    """Zero moments for flat parameter ``p``, on its device."""
    n = p.numel()
    if bits == 32:
        return AdamState32(torch.zeros(n, device=p.device), torch.zeros(n, device=p.device))
    if bits != 8:
        raise ValueError(f"state bits must be 32 or 8, got {bits}")
    if block <= 0:
        raise ValueError(f"quantization block must be positive, got {block}")
    zeros = torch.zeros(n, device=p.device)
    m = quantize_blockwise(zeros, dynamic_code(True, p.device), block)
    v = quantize_blockwise(zeros, dynamic_code(False, p.device), block)
    return AdamState8(m[0], m[1], v[0], v[1], block)


@functools.lru_cache(maxsize=None)
def _fused_available(device_type: str) -> bool:
    """Whether torch has a fused AdamW kernel for this device type (probed once)."""
    if not hasattr(torch, "_fused_adamw_"):
        return False
    p, g, m, v = (torch.zeros(1, device=device_type) for _ in range(4))
    try:
        torch._fused_adamw_([p], [g], [m], [v], [], [torch.ones((), device=device_type)], lr=0.0, beta1=0.9, beta2=0.9,
                            weight_decay=0.0, eps=1.0, amsgrad=False, maximize=False)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _adamw_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hp: AdamConfig,
            step: int, step_t: torch.Tensor, scratch: Scratch) -> None:
    """One in-place AdamW update of fp32 chunks (``step`` counts from 1; ``step_t`` is it as a tensor)."""
    beta1, beta2 = hp.betas
    if _fused_available(p.device.type):
        torch._fused_adamw_([p], [g], [m], [v], [], [step_t], lr=hp.lr, beta1=beta1, beta2=beta2,
                            weight_decay=hp.weight_decay, eps=hp.eps, amsgrad=False, maximize=False)
        return
    p.mul_(1 - hp.lr * hp.weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = torch.sqrt(v, out=scratch.get("denom", v.numel(), torch.float32, v.device))
    denom.div_(math.sqrt(1 - beta2 ** step)).add_(hp.eps)
    p.addcdiv_(m, denom, value=-hp.lr / (1 - beta1 ** step))


def _check(p: torch.Tensor, g: torch.Tensor, state: AdamState, out: torch.Tensor | None,
           source: tuple[torch.Tensor, AdamState] | None) -> None:
    n = p.numel()
    params = [("parameter", p)] + ([] if source is None else [("source parameter", source[0])])
    for name, t in params + [("out", out)]:
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (it is updated through flat views)")
    for name, t in params:
        if t.dtype != torch.float32:
            raise ValueError(f"adam_step keeps fp32 weights, got a {name} of {t.dtype}")
    states = [("", state)] + ([] if source is None else [("source ", source[1])])
    for prefix, s in states:
        if type(s) is not type(state) or getattr(s, "block", None) != getattr(state, "block", None):
            raise ValueError(f"source state {type(s).__name__} does not match state {type(state).__name__}")
        params += [(prefix + "exp_avg", s.exp_avg), (prefix + "exp_avg_sq", s.exp_avg_sq)]
    for name, t in params + [("gradient", g), ("out", out)]:
        if t is not None and (t.numel() != n or t.device != p.device):
            raise ValueError(f"{name} has {t.numel()} elements on {t.device}, the parameter {n} on {p.device}")


def adam_step(p: torch.Tensor, g: torch.Tensor, state: AdamState, hp: AdamConfig, step: int, *,
              out: torch.Tensor | None = None, chunk: int | None = None,
              source: tuple[torch.Tensor, AdamState] | None = None, scratch: Scratch | None = None) -> None:
    """AdamW step number ``step`` (from 1, for the bias correction) on ``p`` and ``state`` in place.

    ``g`` may be of any float dtype (it is widened chunk by chunk); ``out`` receives the new
    weights cast to its dtype (e.g. the bf16 copy for the device). With ``source=(p0, state0)``
    the step reads the old weights and moments from there and writes the new ones into ``p`` and
    ``state``, leaving the source untouched (a step that can be thrown away). ``scratch`` keeps
    the chunk temporaries between calls (see scratch.py); pass the same one to every call. On a GPU,
    8-bit moments are updated by a few compiled launches per tensor instead (``fused8``).
    """
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    _check(p, g, state, out, source)
    p, g = p.view(-1), g.reshape(-1)
    out = None if out is None else out.view(-1)
    src_p, src = source if source is not None else (p, state)
    src_p = src_p.view(-1)
    n = p.numel()
    chunk = chunk or (CUDA_CHUNK if p.device.type == "cuda" else CPU_CHUNK)
    step_t = torch.full((), float(step), device=p.device)  # a fill, so no host sync on CUDA
    scratch = scratch or Scratch()
    eight_bit = isinstance(state, AdamState8)
    done = _fused_8bit(p, g, state, hp, step, out) if eight_bit and source is None else 0
    left = n - done
    if eight_bit:
        block = state.block
        chunk = max(block, chunk // block * block)  # chunks cut along quantization blocks
        codes = dynamic_code(True, p.device), dynamic_code(False, p.device)
        m_buf = scratch.get("m", min(chunk, left), torch.float32, p.device)
        v_buf = scratch.get("v", min(chunk, left), torch.float32, p.device)
    g_buf = None if g.dtype == torch.float32 else scratch.get("g", min(chunk, left), torch.float32, p.device)
    for lo in range(done, n, chunk):
        hi = min(lo + chunk, n)
        pc = p[lo:hi]
        if source is not None:
            pc.copy_(src_p[lo:hi])
        gc = g[lo:hi] if g_buf is None else g_buf[:hi - lo].copy_(g[lo:hi])
        if eight_bit:
            blocks = slice(lo // block, n_blocks(hi, block))
            m = dequantize_blockwise(src.exp_avg[lo:hi], src.exp_avg_absmax[blocks], codes[0], block,
                                     m_buf[:hi - lo], scratch)
            v = dequantize_blockwise(src.exp_avg_sq[lo:hi], src.exp_avg_sq_absmax[blocks], codes[1], block,
                                     v_buf[:hi - lo], scratch)
            _adamw_(pc, gc, m, v, hp, step, step_t, scratch)
            quantize_blockwise(m, codes[0], block, (state.exp_avg[lo:hi], state.exp_avg_absmax[blocks]), scratch)
            quantize_blockwise(v, codes[1], block, (state.exp_avg_sq[lo:hi], state.exp_avg_sq_absmax[blocks]), scratch)
        else:
            m, v = state.exp_avg[lo:hi], state.exp_avg_sq[lo:hi]
            if source is not None:
                m.copy_(src.exp_avg[lo:hi])
                v.copy_(src.exp_avg_sq[lo:hi])
            _adamw_(pc, gc, m, v, hp, step, step_t, scratch)
        if out is not None:
            out[lo:hi].copy_(pc)


def _fused_8bit(p: torch.Tensor, g: torch.Tensor, state: AdamState8, hp: AdamConfig, step: int,
                out: torch.Tensor | None) -> int:
    """The whole blocks of an 8-bit update on a GPU by ``fused8.adamw8_rows``, compiled; the elements done
    (0 elsewhere: the chunk loop does them all)."""
    block, n = state.block, p.numel()
    full = n // block * block
    if p.device.type != "cuda" or not full:
        return 0
    rows = fused(adamw8_rows, p.device)
    tables = rows_args((dynamic_code(True, p.device), dynamic_code(False, p.device)))
    scalars = step_scalars(hp.lr, hp.weight_decay, hp.betas, step, p.device)
    span = max(block, FUSED_CHUNK // block * block)
    for lo in range(0, full, span):
        hi = min(lo + span, full)
        blocks = slice(lo // block, hi // block)
        shaped = [t[lo:hi].view(-1, block) for t in (p, g, state.exp_avg, state.exp_avg_sq)]
        rows(shaped[0], shaped[1], shaped[2], state.exp_avg_absmax[blocks], shaped[3], state.exp_avg_sq_absmax[blocks],
             None if out is None else out[lo:hi].view(-1, block), *tables, scalars, *hp.betas, hp.eps)
    return full
