"""Llama-class decoders (Llama 3.x, Mistral, Qwen 2 / 2.5, Qwen3): RMSNorm, rotary positions, grouped-query
attention, a SwiGLU MLP, a head tied to the embedding or its own."""
from nanotrain.core.models.family import Family
from nanotrain.core.models.llama.config import PRESETS, LlamaConfig, RopeScaling
from nanotrain.core.models.llama.hf import LAYOUT
from nanotrain.core.models.llama.spec import llama_spec
HUB_IDS = {
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B", "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B", "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B", "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B-Base", "qwen3-8b": "Qwen/Qwen3-8B-Base", "mistral-7b": "mistralai/Mistral-7B-v0.3",
}
FAMILY = Family("llama", LlamaConfig, PRESETS, llama_spec, LAYOUT, HUB_IDS)

__all__ = ["FAMILY", "LlamaConfig", "PRESETS", "RopeScaling", "llama_spec"]
