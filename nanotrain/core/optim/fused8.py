"""AdamW on 8-bit moments as one expression over whole quantization blocks, compiled on GPUs.

``adam.adam_step`` walks a tensor in chunks of 4M elements on the GPU, and each chunk of an 8-bit
update is a dozen launches from Python (widen the gradient, dequantize two moments, update,
requantize two moments, cast the weights): gpt2-xl's updates spent ~0.34 s a step launching them.
Here the chain is one function of a tensor's whole blocks, ``[rows, block]`` views, that
``kernels.fused`` compiles on CUDA into a few kernels that write the masters, both moments' codes and
scales and the compute-dtype copy in place. The fp32 moments exist only inside those kernels, so
nothing bounds the tensor's size but ``FUSED_CHUNK``, which caps what the compiler may still
materialise (two fp32 moments per element) should it not fuse everything.

The arithmetic is the eager ``adam._adamw_``'s (as ``torch.optim.AdamW``'s single-tensor path) and the
quantization is ``quant8``'s row expressions, so against ``adam_step`` on the CPU (torch's fused
kernel, ``quant8``'s in-place path) the weights agree to fp32 rounding and a code may move to its
neighbour where rounding carries a moment across a midpoint (``tests/core/test_optim_fused8.py`` bounds both).
"""
from __future__ import annotations

import torch

from nanotrain.core.optim.quant8 import Code, dequantize_rows, quantize_rows

FUSED_CHUNK = 1 << 25  # elements per call: at most 256 MiB of fp32 moments if the compiler keeps them


def adamw8_rows(p: torch.Tensor, g: torch.Tensor, m_q: torch.Tensor, m_absmax: torch.Tensor, v_q: torch.Tensor,
                v_absmax: torch.Tensor, out: torch.Tensor | None, m_values: torch.Tensor, m_below: torch.Tensor,
                m_bin_mid: torch.Tensor, v_values: torch.Tensor, v_below: torch.Tensor, v_bin_mid: torch.Tensor,
                scalars: torch.Tensor, beta1: float, beta2: float, eps: float) -> None:
    """One AdamW step of whole blocks in place: ``p``, ``g`` [rows, block] (``g`` of any float dtype), the
    moments' codes [rows, block] and scales [rows], ``out`` (or None) [rows, block] in the compute dtype.

    ``scalars`` holds (1 - lr * weight_decay, lr / (1 - beta1^step), sqrt(1 - beta2^step)) as a tensor, so a
    compiled copy serves every step and learning rate."""
    decay, step_size, bias2_sqrt = scalars[0], scalars[1], scalars[2]
    gf = g.float()
    m = torch.lerp(dequantize_rows(m_q, m_absmax, m_values).view(p.shape), gf, 1 - beta1)
    v = dequantize_rows(v_q, v_absmax, v_values).view(p.shape) * beta2 + gf * gf * (1 - beta2)
    new_p = p * decay - step_size * (m / (v.sqrt() / bias2_sqrt + eps))
    mq, ma = quantize_rows(m, m_below, m_bin_mid, True, m_values.numel() // 2)
    vq, va = quantize_rows(v, v_below, v_bin_mid, False, v_values.numel() // 2)
    p.copy_(new_p)
    m_q.copy_(mq.view(m_q.shape))
    m_absmax.copy_(ma)
    v_q.copy_(vq.view(v_q.shape))
    v_absmax.copy_(va)
    if out is not None:
        out.copy_(new_p)


def step_scalars(lr: float, weight_decay: float, betas: tuple[float, float], step: int,
                 device: torch.device) -> torch.Tensor:
    """``adamw8_rows``' scalars for step ``step``, made by fills (a tensor from a list would sync the host)."""
    values = (1 - lr * weight_decay, lr / (1 - betas[0] ** step), (1 - betas[1] ** step) ** 0.5)
    out = torch.empty(3, dtype=torch.float32, device=device)
    for i, value in enumerate(values):
        out[i].fill_(value)
    return out


def rows_args(codes: tuple[Code, Code]) -> tuple[torch.Tensor, ...]:
    """The code tables ``adamw8_rows`` takes, signed (first moment) then unsigned (second)."""
    return (codes[0].values, codes[0].below, codes[0].bin_mid, codes[1].values, codes[1].below, codes[1].bin_mid)
