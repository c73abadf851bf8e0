"""The Llama-class hyperparameters as a plain dataclass, and named presets with the published shapes.

One config covers four ``transformers`` architectures that differ in two switches: Llama 3.x (and
Llama-2-style configs) and Mistral are the plain block, Qwen 2 / 2.5 adds biases to q, k and v, Qwen3
normalises each query and key head (RMSNorm over the head dim) and may set a head dim other than
``n_embd / n_head``. ``architecture`` names which one a config is: it decides the two switches and the
``config.json`` it is written as (``hf.to_config``).
"""
from __future__ import annotations

from dataclasses import dataclass

from nanotrain.core.models.spec import check_sizes
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")  # transformers' model_type values
ROPE_SCALINGS = ("llama3", "linear")


@dataclass(frozen=True)
class RopeScaling:
    """Scaled rotary frequencies for contexts longer than pre-training's. ``linear``: every inverse frequency
    over ``factor``. ``llama3`` (Llama 3.1+): wavelengths above ``original_max_position_embeddings /
    low_freq_factor`` over ``factor``, below ``... / high_freq_factor`` unchanged, a smooth blend between."""
    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"rope scaling {self.kind!r} is not supported (supported: {', '.join(ROPE_SCALINGS)})")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor={self.factor} must be > 0")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"llama3 rope scaling needs 0 < low_freq_factor ({self.low_freq_factor}) < "
                             f"high_freq_factor ({self.high_freq_factor})")


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int = 16
    n_embd: int = 2048
    n_head: int = 32
    n_kv_head: int = 8                   # key/value heads, each shared by n_head / n_kv_head query heads
    head_dim: int | None = None          # None: n_embd // n_head (Qwen3-0.6B has its own)
    intermediate_size: int = 8192        # the MLP's hidden neurons (gate and up each)
    vocab_size: int = 128256
    n_ctx: int = 131072                  # max_position_embeddings
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    architecture: str = "llama"          # one of ARCHITECTURES
    sliding_window: int | None = None    # Mistral / Qwen: attention only over this many latest tokens
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    bos_token_id: int | None = None      # carried to config.json for generation; the model never reads them
    eos_token_id: int | tuple[int, ...] | None = None  # several in some chat models' files

    def __post_init__(self) -> None:
        check_sizes(self, "n_layer", "n_embd", "n_head", "n_kv_head", "intermediate_size", "vocab_size", "n_ctx")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one of {', '.join(ARCHITECTURES)}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")
        if self.head_dim is None and self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; set head_dim")
        if self.heads[2] % 2:
            raise ValueError(f"head_dim={self.heads[2]} must be even (rotary embeddings turn pairs of features)")
        if self.sliding_window is not None and (self.sliding_window < 1 or self.architecture == "llama"):
            raise ValueError(f"sliding_window={self.sliding_window}: needs a positive window and an architecture "
                             f"that has one (mistral, qwen2, qwen3), not {self.architecture}")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"attention_dropout={self.attention_dropout} must be in [0, 1)")

    @property
    def heads(self) -> tuple[int, int, int]:
        """Query heads, key/value heads, head dim."""
        return self.n_head, self.n_kv_head, self.head_dim or self.n_embd // self.n_head

    @property
    def attention_bias(self) -> bool:
        """Biases on q, k and v (not on the output projection): Qwen 2 / 2.5."""
        return self.architecture == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """RMSNorm over each query and key head before the rotation: Qwen3."""
        return self.architecture == "qwen3"


_LLAMA3 = RopeScaling("llama3", factor=32.0)  # Llama 3.2: factor 32, low 1, high 4, from 8192 positions

PRESETS: dict[str, LlamaConfig] = {
    # The values of each model's published config.json (Hugging Face hub).
    "llama-3.2-1b": LlamaConfig(n_layer=16, n_embd=2048, n_head=32, n_kv_head=8, intermediate_size=8192,
                                rope_scaling=_LLAMA3, tie_word_embeddings=True, bos_token_id=128000,
                                eos_token_id=128001),
    "llama-3.2-3b": LlamaConfig(n_layer=28, n_embd=3072, n_head=24, n_kv_head=8, intermediate_size=8192,
                                rope_scaling=_LLAMA3, tie_word_embeddings=True, bos_token_id=128000,
                                eos_token_id=128001),
    "llama-3.1-8b": LlamaConfig(n_layer=32, n_embd=4096, n_head=32, n_kv_head=8, intermediate_size=14336,
                                rope_scaling=RopeScaling("llama3", factor=8.0), bos_token_id=128000,
                                eos_token_id=128001),
    "llama-3.1-70b": LlamaConfig(n_layer=80, n_embd=8192, n_head=64, n_kv_head=8, intermediate_size=28672,
                                 rope_scaling=RopeScaling("llama3", factor=8.0), bos_token_id=128000,
                                 eos_token_id=128001),
    "qwen2.5-0.5b": LlamaConfig(n_layer=24, n_embd=896, n_head=14, n_kv_head=2, intermediate_size=4864,
                                vocab_size=151936, n_ctx=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                tie_word_embeddings=True, architecture="qwen2", bos_token_id=151643,
                                eos_token_id=151643),
    "qwen2.5-7b": LlamaConfig(n_layer=28, n_embd=3584, n_head=28, n_kv_head=4, intermediate_size=18944,
                              vocab_size=152064, n_ctx=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
                              architecture="qwen2", bos_token_id=151643, eos_token_id=151643),
    "qwen2.5-32b": LlamaConfig(n_layer=64, n_embd=5120, n_head=40, n_kv_head=8, intermediate_size=27648,
                               vocab_size=152064, n_ctx=131072, rms_norm_eps=1e-5, rope_theta=1000000.0,
                               architecture="qwen2", bos_token_id=151643, eos_token_id=151643),
    "qwen3-0.6b": LlamaConfig(n_layer=28, n_embd=1024, n_head=16, n_kv_head=8, head_dim=128, intermediate_size=3072,
                              vocab_size=151936, n_ctx=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                              tie_word_embeddings=True, architecture="qwen3", bos_token_id=151643,
                              eos_token_id=151643),
    "qwen3-8b": LlamaConfig(n_layer=36, n_embd=4096, n_head=32, n_kv_head=8, intermediate_size=12288,
                            vocab_size=151936, n_ctx=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                            architecture="qwen3", bos_token_id=151643, eos_token_id=151643),
    "mistral-7b": LlamaConfig(n_layer=32, n_embd=4096, n_head=32, n_kv_head=8, intermediate_size=14336,
                              vocab_size=32768, n_ctx=32768, rope_theta=1000000.0, architecture="mistral",
                              bos_token_id=1, eos_token_id=2),
    # CPU tests: grouped-query attention (6 query heads over 2 key/value heads), an MLP width that is no multiple
    # of 64, an untied head, llama3 rope scaling with frequencies in each of its three bands (head dim 8, theta
    # 100: wavelengths 6, 20, 63 and 199 against 8 and 32). No real tokenizer fits its vocabulary.
    "tiny-llama": LlamaConfig(n_layer=2, n_embd=48, n_head=6, n_kv_head=2, intermediate_size=100, vocab_size=320,
                              n_ctx=128, rope_theta=100.0,
                              rope_scaling=RopeScaling("llama3", factor=4.0, original_max_position_embeddings=32)),
}
