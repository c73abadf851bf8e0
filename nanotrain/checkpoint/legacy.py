"""The old one-process layout, read as the one format: a checkpoint saved before it resumes at any layout.

Until the one format, one process (and DDP's first rank) saved a Hugging Face folder (``model.safetensors``,
``config.json``) and ``optimizer.safetensors``: masters, moments and step counts by leaf path
(``master.<path>``, ...). That file is one shard of whole leaves whose pieces are named by their paths, so its
manifest is written here from the model's config and the file's keys, and ``slices.SliceReader`` reads it as it
reads any checkpoint. ``model.safetensors`` repeats the masters and is never read.
"""
from __future__ import annotations

import json
from math import prod
from pathlib import Path

from nanotrain.core.models import model_spec
from nanotrain.core.optim import OffloadConfig
from nanotrain.core.train.shard import SCALARS
from weights import read_config
from weights.safetensors_io import SafetensorsReader

OPTIMIZER = "optimizer.safetensors"


def is_old(ckpt: Path) -> bool:
    """Whether ``ckpt`` is a checkpoint of the old one-process layout."""
    return (ckpt / OPTIMIZER).is_file() and (ckpt / "trainer.json").is_file()


def old_manifest(ckpt: Path) -> dict:
    """The manifest of an old one-process checkpoint (without its ``format``, which the reader adds): one shard
    of whole leaves in ``optimizer.safetensors``. Its 8-bit moments were quantized in the one block every run
    used (``OffloadConfig.block``; a piece of another length is refused when it is read)."""
    spec = model_spec(read_config(ckpt))
    with SafetensorsReader(ckpt / OPTIMIZER) as f:
        keys = set(f.keys())
    block = OffloadConfig.block if any("_absmax." in k for k in keys) else None
    return {"step": json.loads((ckpt / "trainer.json").read_text())["step"], "layout": {"dp": 1}, "block": block,
            "scalars": [k for k in SCALARS if k in keys], "files": [OPTIMIZER],
            "shards": [{"file": OPTIMIZER, "tp": None,
                        "pieces": [[path, path, 0, prod(shape)] for path, shape in spec.shapes.items()]}]}
