"""Model FLOPs utilisation (MFU) against the vendors' bf16 peaks; the FLOPs come from the model's spec."""
from __future__ import annotations

from typing import Any

from nanotrain.core.models import model_spec
# Dense bf16 tensor-core peak from the vendors' datasheets (no sparsity).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "4090": 165e12, "3090": 71e12}


def flops_per_token(model: Any, seq: int) -> float:
    """Training FLOPs per token of any family's config or spec (``Costs.flops_per_token``)."""
    return model_spec(model).costs.flops_per_token(seq)


def peak_flops(device_name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in device_name), None)


def mfu(tokens_per_s: float, model: Any, seq: int, peak: float | None) -> float | None:
    return None if peak is None else tokens_per_s * flops_per_token(model, seq) / peak
