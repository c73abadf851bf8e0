"""Hugging Face checkpoints in and out for any model family, through its name table (``HFLayout``):
hub fetching, safetensors I/O one tensor at a time, sharded folders, seeded random checkpoints."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nanotrain.core.models import family_of
from nanotrain.core.tree import Tree
from weights.hub import fetch_weights, is_hub_id
from weights.load import load_hf
from weights.resolve import ResolvedModel, read_config, resolve_model
from weights.safetensors_io import CheckpointError
from weights.save import hf_config, preset_name, random_checkpoint, save_hf
from weights.tokenizer_files import copy_tokenizer, write_generation_config, write_tokenizer

__all__ = ["CheckpointError", "ResolvedModel", "copy_tokenizer", "hf_config", "hub_weights",
           "load_hf", "load_weights", "random_checkpoint", "read_config", "resolve_model", "save_hf",
           "write_generation_config", "write_tokenizer"]


def hub_weights(cfg: Any) -> str:
    """The hub repository of the preset ``cfg`` is."""
    family, name = family_of(cfg), preset_name(cfg)
    if name not in family.hub_ids:
        what, known = repr(name) if name else "this config", ", ".join(family.hub_ids)
        raise CheckpointError(f"no pretrained hub weights for model {what} (hub models: {known}); "
                              f"use --weights random or --weights /path/to/folder")
    return family.hub_ids[name]


def load_weights(cfg: Any, source: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 seed: int = 0, random_dtype: torch.dtype | None = None) -> Tree:
    """The parameters of ``cfg`` from ``source``: ``random`` (a seeded checkpoint in the HF layout, written once
    under ``.cache/random-weights`` in ``random_dtype`` (default ``dtype``) and loaded like any other), ``hub``
    (the preset's hub repository), a hub id, or a local folder or file (``model.safetensors``, an index)."""
    if source == "random":
        path = random_checkpoint(cfg, seed, random_dtype or dtype)
    elif source == "hub" or is_hub_id(source):
        path = fetch_weights(hub_weights(cfg) if source == "hub" else source)
    else:
        path = Path(source)
    return load_hf(path, cfg, dtype=dtype, device=device)
