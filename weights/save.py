"""Write any family's parameters as a Hugging Face folder (``config.json``, safetensors shards and their index)
that ``transformers.AutoModelForCausalLM.from_pretrained`` loads, tensor by tensor, in fp32 or the dtype an export
asks (``weights.tokenizer_files`` writes the tokenizer beside them).

A random checkpoint is written the same way from the seeded init stream, so the model is never in memory
whole, and random runs load through the real loading path.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

from nanotrain.core.models import family_of, model_spec, run
from nanotrain.core.tree import Tree, get_path
from weights.files import DEFAULT_SHARD_BYTES, write_checkpoint, write_text
from weights.table import Entry, table

RANDOM_DIR = Path(".cache/random-weights")


def hf_config(cfg: Any) -> dict:
    """The ``config.json`` of ``cfg`` that ``transformers`` loads."""
    return family_of(cfg).hf.to_config(cfg)


def save_leaves(out_dir: Path, cfg: Any, leaves: Iterator[torch.Tensor], dtype: torch.dtype,
                max_shard_bytes: int | None) -> Path:
    """The Hugging Face folder of ``cfg`` in the existing ``out_dir`` from ``leaves``: every leaf's tensor in the
    order of the spec's leaves, asked for one at a time as its file tensors are written, and let go before the
    next is asked for (an export holds one leaf, read from its checkpoint, at a time). Returns the file that
    lists the tensors."""
    entries = table(cfg)
    specs = [(p.name, p.shape, dtype) for e in entries for p in e.parts]
    path = write_checkpoint(out_dir, specs, _file_tensors(entries, leaves), max_shard_bytes)
    dtype_name = str(dtype).removeprefix("torch.")  # what transformers loads them as: 5.x reads dtype, 4.x torch_dtype
    write_text(out_dir / "config.json", json.dumps(hf_config(cfg) | {"dtype": dtype_name, "torch_dtype": dtype_name},
                                                   indent=2))
    return path


def _file_tensors(entries: list[Entry], leaves: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Each entry's tensors in the file (a fused leaf's parts), from its leaf; the next leaf is asked for only
    once this one is let go."""
    for e in entries:
        t = next(leaves)
        yield from e.to_file(t)
        del t


def save_hf(params: Tree, cfg: Any, out_dir: str | Path, max_shard_bytes: int | None = DEFAULT_SHARD_BYTES,
            dtype: torch.dtype = torch.float32) -> Path:
    """``params`` as a Hugging Face folder in ``out_dir``, each tensor rounded to ``dtype`` (to nearest, as
    ``Tensor.to``) as it is written: ``model.safetensors``, or shards of at most ``max_shard_bytes`` (None: one
    file) and their index; ``config.json``. Returns the file that lists the tensors."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return save_leaves(out_dir, cfg, (get_path(params, leaf.path) for leaf in model_spec(cfg).leaves), dtype,
                       max_shard_bytes)


def preset_name(cfg: Any) -> str | None:
    """The name of the preset ``cfg`` is (None: none is)."""
    return next((name for name, preset in family_of(cfg).presets.items() if preset == cfg), None)


def random_checkpoint(cfg: Any, seed: int = 0, dtype: torch.dtype = torch.float32,
                      root: str | Path = RANDOM_DIR) -> Path:
    """The folder of a seeded random checkpoint of ``cfg`` in ``dtype``, written once under ``root``.

    Loading it in ``dtype`` gives exactly ``init_params(cfg, seed, dtype)``: the file holds the init cast to
    ``dtype``, so an 8B model's bf16 file is 16 GB, not 32. The folder is written under a temporary name and
    renamed, so a process that finds it finds it whole (another one may be writing the same beside it).
    """
    label, dtype_name = preset_name(cfg) or family_of(cfg).name, str(dtype).removeprefix("torch.")
    digest = hashlib.sha256(json.dumps(hf_config(cfg), sort_keys=True).encode()).hexdigest()[:8]
    folder = Path(root) / f"{label}-seed{seed}-{dtype_name}-{digest}"
    if folder.is_dir():
        return folder
    print(f"writing random {label} weights (seed {seed}, {dtype_name}) to {folder}", flush=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        save_leaves(tmp, cfg, (t for _, t in run.init_stream(model_spec(cfg), seed)), dtype, DEFAULT_SHARD_BYTES)
        try:
            os.replace(tmp, folder)
        except OSError:
            if not folder.is_dir():  # not a writer beside us that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
