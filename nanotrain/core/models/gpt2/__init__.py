"""GPT-2 (Radford et al. 2019): learned positions, LayerNorm, tanh GELU, a head tied to the embedding."""
from nanotrain.core.models.family import GPT2_BPE, Family
from nanotrain.core.models.gpt2.config import PRESETS, GPT2Config
from nanotrain.core.models.gpt2.hf import LAYOUT
from nanotrain.core.models.gpt2.spec import gpt2_spec
HUB_IDS = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
FAMILY = Family("gpt2", GPT2Config, PRESETS, gpt2_spec, LAYOUT, HUB_IDS, tokenizer=GPT2_BPE)

__all__ = ["FAMILY", "GPT2Config", "PRESETS", "gpt2_spec"]
