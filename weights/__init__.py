"""Hugging Face checkpoints in and out for any model family, through its name table (``HFLayout``):
hub fetching, safetensors I/O one tensor at a time, sharded folders, leaves read as a trainer takes them (random ones
made as taken), seeded random checkpoints as files."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from nanotrain.core.leaves import Leaves, seeded, tree_of
from nanotrain.core.models import family_of, model_spec
from nanotrain.core.tree import Tree
from weights.hub import fetch_weights, is_hub_id
from weights.load import checkpoint_leaves, load_hf
from weights.resolve import ResolvedModel, read_config, resolve_model
from weights.safetensors_io import CheckpointError
from weights.save import hf_config, preset_name, random_checkpoint, save_hf
from weights.tokenizer_files import copy_tokenizer, write_generation_config, write_tokenizer

__all__ = ["CheckpointError", "ResolvedModel", "copy_tokenizer", "hf_config", "hub_weights",
           "load_hf", "load_weights", "open_weights", "random_checkpoint", "read_config", "resolve_model", "save_hf",
           "write_generation_config", "write_tokenizer"]


def hub_weights(cfg: Any) -> str:
    """The hub repository of the preset ``cfg`` is."""
    family, name = family_of(cfg), preset_name(cfg)
    if name not in family.hub_ids:
        what, known = repr(name) if name else "this config", ", ".join(family.hub_ids)
        raise CheckpointError(f"no pretrained hub weights for model {what} (hub models: {known}); "
                              f"use --weights random or --weights /path/to/folder")
    return family.hub_ids[name]


@contextmanager
def open_weights(cfg: Any, source: str, seed: int = 0, random_dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> Iterator[Leaves]:
    """The parameters of ``cfg`` from ``source``, each read when taken (``core.leaves``): ``random`` (made from
    ``seed`` on ``device`` as they are taken, rounded to ``random_dtype``: no file, so a 70B model need not write 141 GB
    before it starts; the same on the same kind of device), ``hub`` (the preset's hub repository), a hub id, or a local
    folder or file (``model.safetensors``, an index)."""
    if source == "random":
        yield seeded(model_spec(cfg), seed, device, random_dtype)
        return
    if source == "hub" or is_hub_id(source):
        path = fetch_weights(hub_weights(cfg) if source == "hub" else source)
    else:
        path = Path(source)
    with checkpoint_leaves(path, cfg) as leaves:
        yield leaves


def load_weights(cfg: Any, source: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 seed: int = 0, random_dtype: torch.dtype | None = None) -> Tree:
    """``open_weights``' parameters as a tree in ``dtype`` on ``device`` (random ones made there, in ``random_dtype``,
    default ``dtype``)."""
    with open_weights(cfg, source, seed, random_dtype or dtype, device) as leaves:
        return tree_of(model_spec(cfg), leaves, dtype, device)
