"""Model FLOPs per token and utilisation (MFU), the way nanoGPT and PaLM count them."""
from __future__ import annotations

from nanotrain.config import GPT2Config

# Dense bf16 tensor-core peak from the vendors' datasheets (no sparsity).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "4090": 165e12, "3090": 71e12}


def flops_per_token(cfg: GPT2Config, seq: int) -> float:
    """6 N (matmuls forward + backward) + 12 L C T (attention scores and values, full square as PaLM counts).

    N excludes the position embedding (a lookup) but includes the token embedding, which is the LM head's matmul.
    """
    n = cfg.num_params() - cfg.n_ctx * cfg.n_embd
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.n_embd * seq


def peak_flops(device_name: str) -> float | None:
    for key, peak in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return peak
    return None


def mfu(tokens_per_s: float, cfg: GPT2Config, seq: int, peak: float | None) -> float | None:
    return None if peak is None else tokens_per_s * flops_per_token(cfg, seq) / peak
