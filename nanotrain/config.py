"""GPT-2 hyperparameters as a plain dataclass with named presets."""
from __future__ import annotations

from dataclasses import dataclass, replace


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
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def has_dropout(self) -> bool:
        return max(self.embd_pdrop, self.attn_pdrop, self.resid_pdrop) > 0

    @classmethod
    def from_name(cls, name: str, **overrides) -> "GPT2Config":
        if name not in PRESETS:
            known = ", ".join(PRESETS)
            raise ValueError(f"unknown model {name!r} (known: {known})")
        return replace(PRESETS[name], **overrides)

    def num_params(self) -> int:
        """Parameter count with the LM head tied to the token embedding."""
        c, n_layer = self.n_embd, self.n_layer
        per_block = 4 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c)
        return self.vocab_size * c + self.n_ctx * c + n_layer * per_block + 2 * c


PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": GPT2Config(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": GPT2Config(n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": GPT2Config(n_layer=48, n_embd=1600, n_head=25),
    # Small enough for CPU tests and demos, same vocabulary so the real tokenizer applies.
    "tiny": GPT2Config(n_layer=2, n_embd=64, n_head=4, n_ctx=128),
}
