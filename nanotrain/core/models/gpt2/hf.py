"""GPT-2 in the Hugging Face layout: ``config.json`` both ways and the tensor name table.

HF's GPT-2 uses ``Conv1D`` layers whose weights are stored ``[in, out]``; ours are ``[out, in]``
(``F.linear``), so those four matrices per block are transposed on the way in and out.
"""
from __future__ import annotations

from nanotrain.core.models.family import HFLayout
from nanotrain.core.models.gpt2.config import GPT2Config
PREFIX = "transformer."
_BLOCK = {
    "ln_1_w": ("ln_1.weight",), "ln_1_b": ("ln_1.bias",),
    "qkv_w": ("attn.c_attn.weight",), "qkv_b": ("attn.c_attn.bias",),
    "proj_w": ("attn.c_proj.weight",), "proj_b": ("attn.c_proj.bias",),
    "ln_2_w": ("ln_2.weight",), "ln_2_b": ("ln_2.bias",),
    "fc_w": ("mlp.c_fc.weight",), "fc_b": ("mlp.c_fc.bias",),
    "fc_proj_w": ("mlp.c_proj.weight",), "fc_proj_b": ("mlp.c_proj.bias",),
}
_TOP = {"wte": PREFIX + "wte.weight", "wpe": PREFIX + "wpe.weight", "ln_f_w": PREFIX + "ln_f.weight",
        "ln_f_b": PREFIX + "ln_f.bias"}


def to_config(cfg: GPT2Config) -> dict:
    """The ``config.json`` that lets ``transformers`` load our files."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.n_ctx, "n_ctx": cfg.n_ctx, "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "layer_norm_epsilon": cfg.layer_norm_eps,
        "embd_pdrop": cfg.embd_pdrop, "attn_pdrop": cfg.attn_pdrop, "resid_pdrop": cfg.resid_pdrop,
        "bos_token_id": 50256, "eos_token_id": 50256, "tie_word_embeddings": True,
    }


def from_config(hf: dict) -> GPT2Config:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"config.json: activation_function {act!r} is not GPT-2's tanh GELU (gelu_new)")
    if hf.get("tie_word_embeddings", True) is False:
        raise ValueError("config.json: tie_word_embeddings is false, but GPT-2's head is its token embedding")
    return GPT2Config(n_layer=hf["n_layer"], n_embd=hf["n_embd"], n_head=hf["n_head"], vocab_size=hf["vocab_size"],
                      n_ctx=hf.get("n_positions", hf.get("n_ctx", 1024)),
                      layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5), embd_pdrop=hf.get("embd_pdrop", 0.0),
                      attn_pdrop=hf.get("attn_pdrop", 0.0), resid_pdrop=hf.get("resid_pdrop", 0.0))


LAYOUT = HFLayout(model_types=("gpt2",), from_config=from_config, to_config=to_config, top=_TOP, block=_BLOCK,
                  layer_prefix=PREFIX + "h.", transposed=("qkv_w", "proj_w", "fc_w", "fc_proj_w"),
                  ignored=(".attn.bias", ".attn.masked_bias"), optional_prefix=PREFIX, tied_copy="lm_head.weight",
                  dropout_keys=("embd_pdrop", "attn_pdrop", "resid_pdrop"))
