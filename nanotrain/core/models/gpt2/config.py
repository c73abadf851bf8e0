"""GPT-2's hyperparameters as a plain dataclass, and its named presets."""
from __future__ import annotations

from dataclasses import dataclass

from nanotrain.core.models.spec import check_sizes
@dataclass(frozen=True)
class GPT2Config:
    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    vocab_size: int = 50257
    n_ctx: int = 1024
    layer_norm_eps: float = 1e-5
    embd_pdrop: float = 0.0
    attn_pdrop: float = 0.0
    resid_pdrop: float = 0.0

    def __post_init__(self) -> None:
        check_sizes(self, "n_layer", "n_embd", "n_head", "vocab_size", "n_ctx")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": GPT2Config(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": GPT2Config(n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": GPT2Config(n_layer=48, n_embd=1600, n_head=25),
    # Small enough for CPU tests and demos, same vocabulary so the real tokenizer applies.
    "tiny": GPT2Config(n_layer=2, n_embd=64, n_head=4, n_ctx=128),
}
