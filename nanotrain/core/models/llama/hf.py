"""The Llama-class family in the Hugging Face layout: ``config.json`` both ways and the tensor name table.

HF keeps q, k, v and gate, up as separate ``nn.Linear`` weights (``[out, in]`` like ours); ours are fused, so
one leaf is several HF tensors stacked along dim 0 (``HFName.hf``). Everything HF's four architectures can
say that this family does not compute is refused by name rather than dropped.
"""
from __future__ import annotations

from nanotrain.core.models.family import HFLayout
from nanotrain.core.models.llama.config import ARCHITECTURES, LlamaConfig, RopeScaling

ARCHITECTURE_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "mistral": "MistralForCausalLM"}
_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_BLOCK = {
    "attn_norm_w": ("input_layernorm.weight",),
    "qkv_w": tuple(f"{m}.weight" for m in _ATTN), "qkv_b": tuple(f"{m}.bias" for m in _ATTN),
    "q_norm_w": ("self_attn.q_norm.weight",), "k_norm_w": ("self_attn.k_norm.weight",),
    "o_w": ("self_attn.o_proj.weight",),
    "mlp_norm_w": ("post_attention_layernorm.weight",),
    "gate_up_w": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_w": ("mlp.down_proj.weight",),
}
_TOP = {"wte": "model.embed_tokens.weight", "norm_w": "model.norm.weight", "lm_head_w": "lm_head.weight"}


def to_config(cfg: LlamaConfig) -> dict:
    """The ``config.json`` that lets ``transformers`` (4.x and 5.x) load our files as ``cfg.architecture``."""
    n_head, n_kv, d = cfg.heads
    out = {
        "architectures": [ARCHITECTURE_CLASS[cfg.architecture]], "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": n_head, "num_key_value_heads": n_kv, "head_dim": d,
        "hidden_act": "silu", "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
    }
    s = cfg.rope_scaling
    if s is not None:
        out["rope_scaling"] = {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            out["rope_scaling"].update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                                       original_max_position_embeddings=s.original_max_position_embeddings)
    if cfg.architecture in ("llama", "qwen3"):
        out["attention_bias"] = False  # theirs would put a bias on o_proj too
    if cfg.architecture == "llama":
        out["mlp_bias"] = False
    elif cfg.architecture == "mistral":
        out["sliding_window"] = cfg.sliding_window
    else:  # Qwen: every layer windowed when there is a window (max_window_layers counts the full ones)
        out.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                   max_window_layers=0 if cfg.sliding_window else cfg.n_layer)
    return out


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling: from 4.x's ``rope_theta`` and ``rope_scaling``, or 5.x's ``rope_parameters``."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("config.json: partial_rotary_factor != 1 (rotating part of each head) is not supported")
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", scaling["factor"])
    if kind != "llama3":
        raise ValueError(f"config.json: rope scaling type {kind!r} is not supported (supported: llama3, linear)")
    return theta, RopeScaling("llama3", scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
                              scaling.get("original_max_position_embeddings", hf.get("max_position_embeddings")))


def _sliding_window(hf: dict, model_type: str) -> int | None:
    """Mistral's ``sliding_window``; Qwen's only when ``use_sliding_window`` and some layer slides (their files
    carry a window regardless; layers from ``max_window_layers`` on slide, or as ``layer_types`` lists)."""
    if model_type == "mistral":
        return hf.get("sliding_window")
    if model_type == "llama" or not hf.get("use_sliding_window"):
        return None
    first = hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or ["sliding_attention" * (i >= first) for i in range(hf["num_hidden_layers"])]
    return hf.get("sliding_window") if "sliding_attention" in types else None


def from_config(hf: dict) -> LlamaConfig:
    model_type = hf.get("model_type", "llama")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"config.json: model_type {model_type!r} is not one of {', '.join(ARCHITECTURES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {hf['hidden_act']!r} is not SwiGLU's silu")
    if hf.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias is true, but this family's MLP has no biases")
    if hf.get("attention_bias") and model_type != "qwen2":
        raise ValueError(f"config.json: attention_bias is true, which for {model_type} puts a bias on o_proj too "
                         f"(not supported; only Qwen2's q/k/v biases are)")
    theta, scaling = _rope(hf)
    head_dim = hf.get("head_dim")  # kept only where it is not n_embd / n_head, as in our presets
    return LlamaConfig(
        n_layer=hf["num_hidden_layers"], n_embd=hf["hidden_size"], n_head=hf["num_attention_heads"],
        n_kv_head=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=None if head_dim == hf["hidden_size"] // hf["num_attention_heads"] else head_dim,
        intermediate_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        n_ctx=hf.get("max_position_embeddings", 2048), rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta,
        rope_scaling=scaling, tie_word_embeddings=hf.get("tie_word_embeddings", False), architecture=model_type,
        sliding_window=_sliding_window(hf, model_type), attention_dropout=hf.get("attention_dropout", 0.0),
        initializer_range=hf.get("initializer_range", 0.02), bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos := hf.get("eos_token_id"), list) else eos)


LAYOUT = HFLayout(model_types=ARCHITECTURES, from_config=from_config, to_config=to_config, top=_TOP, block=_BLOCK,
                  layer_prefix="model.layers.", ignored=(".rotary_emb.inv_freq",), tied_copy="lm_head.weight",
                  dropout_keys=("attention_dropout",))
