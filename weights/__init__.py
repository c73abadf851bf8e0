"""Checkpoint fetching, conversion and safetensors I/O for nanotrain's GPT-2."""
from __future__ import annotations

from pathlib import Path

import torch

from nanotrain.models.gpt2 import GPT2Config
from nanotrain.tree import Tree
from weights.gpt2 import load_gpt2, save_gpt2, write_random_gpt2
from weights.hub import fetch
from weights.safetensors_io import CheckpointError

__all__ = ["CheckpointError", "load_gpt2", "save_gpt2", "write_random_gpt2", "fetch", "load_weights"]

RANDOM_DIR = Path(".cache/random-weights")


def load_weights(spec: str, model: str, cfg: GPT2Config, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0) -> Tree:
    """``spec`` is ``hub``, ``random`` or a path to a ``model.safetensors`` (or its folder).

    ``random`` writes a seeded random checkpoint in the HF layout once (cached under
    ``.cache/random-weights``) and loads it, so random runs exercise the real loading path.
    """
    if spec == "hub":
        path = fetch(model)
    elif spec == "random":
        path = RANDOM_DIR / f"{model}-seed{seed}" / "model.safetensors"
        if not path.exists():
            print(f"writing random {model} weights (seed {seed}) to {path}", flush=True)
            write_random_gpt2(cfg, path, seed)
    else:
        path = Path(spec)
        if path.is_dir():
            path = path / "model.safetensors"
    return load_gpt2(path, cfg, dtype=dtype, device=device)
