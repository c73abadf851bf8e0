"""Load any family's parameters from a Hugging Face checkpoint, through its name table, tensor by tensor.

Every name and shape is checked against the model's config from the files' headers before a byte of data
is read; each error is one line naming the file and the tensor, never a silent re-initialisation. Then
each leaf is read when a trainer takes it (``core.leaves.Leaves``), or read, converted and placed on its own
into a tree: the model is never in host memory twice.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from nanotrain.core.leaves import Leaves, tree_of
from nanotrain.core.models import family_of, model_spec
from nanotrain.core.tree import Tree
from weights.files import CheckpointFiles
from weights.safetensors_io import CheckpointError
from weights.table import Entry, describe, table

WRONG_MODEL = "wrong --model for this checkpoint?"


def _file_names(entries: list[Entry], prefix: str, keys: set[str]) -> dict[str, str]:
    """Table name -> the name in these files, which may lack the layout's optional prefix."""
    strip = bool(prefix) and not any(k.startswith(prefix) for k in keys)
    return {p.name: p.name.removeprefix(prefix) if strip else p.name for e in entries for p in e.parts}


def _check(files: CheckpointFiles, cfg: Any, entries: list[Entry], names: dict[str, str],
           tied: str | None) -> None:
    spec, layout = model_spec(cfg), family_of(cfg).hf
    keys = files.keys()
    unexpected = sorted(k for k in keys - set(names.values()) if k != tied and not k.endswith(layout.ignored))
    if unexpected:
        raise CheckpointError(f"{files.file_of(unexpected[0])} has tensors a {describe(spec)} does not: "
                              f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''} ({WRONG_MODEL})")
    for e in entries:
        for part in e.parts:
            name = names[part.name]
            if name not in keys:
                raise CheckpointError(f"{files.path} is missing tensor {name!r} ({e.leaf} of a {describe(spec)}, "
                                      f"shape {part.shape}); {WRONG_MODEL}")
            if files.shape(name) != part.shape:
                raise CheckpointError(f"tensor {name!r} in {files.file_of(name)} has shape {files.shape(name)}, "
                                      f"expected {part.shape} for a {describe(spec)} ({WRONG_MODEL})")


@contextmanager
def checkpoint_leaves(path: str | Path, cfg: Any) -> Iterator[Leaves]:
    """The leaves of ``cfg`` in a checkpoint (a ``.safetensors`` file, an index, or a folder of either), every name and
    shape checked before any is read, each read from the files when taken (in the file's dtype, on the host).

    A tensor the layout calls a tied copy (GPT-2's ``lm_head.weight``) may be there, and must equal the leaf the head
    multiplies with: checked when that leaf is read.
    """
    spec, layout = model_spec(cfg), family_of(cfg).hf
    entries = {e.leaf: e for e in table(cfg)}
    with CheckpointFiles(path) as files:
        names = _file_names(list(entries.values()), layout.optional_prefix, files.keys())
        tied = layout.tied_copy if layout.tied_copy not in names else None
        _check(files, cfg, list(entries.values()), names, tied)

        def read(leaf: str) -> torch.Tensor:
            t = entries[leaf].from_file([files.get(names[p.name]) for p in entries[leaf].parts])
            head_copy = leaf == spec.head_weight and tied in files.keys()  # a tied copy, which must equal the leaf
            if head_copy and not torch.equal(files.get(tied).float(), t.float()):
                raise CheckpointError(f"{files.file_of(tied)}: tensor {tied!r} differs from {spec.head_weight}, the "
                                      f"embedding the model's head is tied to; not a checkpoint of this model")
            return t

        yield Leaves(dict(spec.shapes), read)


def load_hf(path: str | Path, cfg: Any, dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu") -> Tree:
    """Every parameter of ``cfg`` from a checkpoint (``checkpoint_leaves``), as a tree in ``dtype`` on ``device``."""
    with checkpoint_leaves(path, cfg) as leaves:
        return tree_of(model_spec(cfg), leaves, dtype, device)
