"""Load and save GPT-2 parameters in Hugging Face's safetensors layout, through the name table."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from nanotrain.models.gpt2 import GPT2Config
from nanotrain.model import empty_tree, init_stream
from nanotrain.tree import Tree, get_path, set_path
from weights.names import PREFIX, TIED_HEAD, is_ignored, name_table
from weights.safetensors_io import CheckpointError, SafetensorsReader, write_safetensors


def load_gpt2(path: str | Path, cfg: GPT2Config, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> Tree:
    """Read every parameter of ``cfg`` from an HF GPT-2 ``model.safetensors``, one tensor at a time.

    Accepts names with or without the ``transformer.`` prefix. Any missing, unexpected or
    misshapen tensor is an error naming it and the file; nothing is silently initialised.
    """
    params = empty_tree(cfg)
    with SafetensorsReader(path) as f:
        keys = set(f.keys())
        prefix = PREFIX if any(k.startswith(PREFIX) for k in keys) else ""
        table = name_table(cfg)
        expected = {prefix + e.hf for e in table}
        unexpected = sorted(k for k in keys - expected if not is_ignored(k) and k != TIED_HEAD)
        if unexpected:
            raise CheckpointError(f"{f.path} has tensors a {cfg.n_layer}-layer GPT-2 does not: "
                                  f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''} "
                                  f"(wrong --model preset for this file?)")
        for e in table:
            name = prefix + e.hf
            if name not in keys:
                raise CheckpointError(f"{f.path} is missing tensor {name!r} (ours: {e.ours}, shape {e.hf_shape}); "
                                      f"wrong --model preset for this file?")
            shape = f.shape(name)
            if shape != e.hf_shape:
                raise CheckpointError(f"tensor {name!r} in {f.path} has shape {shape}, expected {e.hf_shape} "
                                      f"for {cfg.n_layer} layers x {cfg.n_embd} wide (wrong --model preset?)")
            t = f.get(name)
            t = t.t() if e.transpose else t
            set_path(params, e.ours, t.to(device=device, dtype=dtype).contiguous())
        if TIED_HEAD in keys and not torch.equal(f.get(TIED_HEAD).to(dtype), params["wte"].cpu().to(dtype)):
            raise CheckpointError(f"{f.path}: {TIED_HEAD} differs from the token embedding, "
                                  f"but GPT-2's head is tied to it; this is not a GPT-2 checkpoint")
    return params


def hf_config(cfg: GPT2Config) -> dict:
    """The ``config.json`` that lets ``transformers`` load our files."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.n_ctx, "n_ctx": cfg.n_ctx, "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "layer_norm_epsilon": cfg.layer_norm_eps,
        "embd_pdrop": cfg.embd_pdrop, "attn_pdrop": cfg.attn_pdrop, "resid_pdrop": cfg.resid_pdrop,
        "bos_token_id": 50256, "eos_token_id": 50256, "tie_word_embeddings": True,
    }


def _specs(cfg: GPT2Config, dtype: torch.dtype):
    return [(PREFIX + e.hf, e.hf_shape, dtype) for e in name_table(cfg)]


def save_gpt2(params: Tree, cfg: GPT2Config, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``out_dir/model.safetensors`` + ``config.json`` that ``GPT2LMHeadModel.from_pretrained`` reads."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = {PREFIX + e.hf: e for e in name_table(cfg)}

    def produce(name: str) -> torch.Tensor:
        e = table[name]
        t = get_path(params, e.ours)
        return t.t() if e.transpose else t

    path = write_safetensors(out_dir / "model.safetensors", _specs(cfg, dtype), produce)
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg), indent=2))
    return path


def write_random_gpt2(cfg: GPT2Config, path: str | Path, seed: int = 0) -> Path:
    """A randomly initialised checkpoint in the HF layout, streamed: the model is never in memory whole.

    Loading it gives exactly ``init_params(cfg, seed)``.
    """
    table = name_table(cfg)
    stream = (t.t() if e.transpose else t for e, (_, t) in zip(table, init_stream(cfg, seed)))
    path = write_safetensors(path, _specs(cfg, torch.float32), stream)
    path.with_name("config.json").write_text(json.dumps(hf_config(cfg), indent=2))
    return path
