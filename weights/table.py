"""The name table of any family, in the checkpoint's terms: for each leaf of ours, the Hugging Face tensors it
is made of (their names and shapes in the file, the rows of ours each fills), from the family's ``HFLayout``.

One leaf may be several HF tensors concatenated along our dim 0 (a fused q/k/v or gate/up matrix): the
leaf's tensor-parallel placement already says how many rows each segment has (so many heads of head_dim
rows, so many neurons), which gives each part's rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from nanotrain.core.models.registry import family_of, model_spec
from nanotrain.core.models.spec import Leaf, ModelSpec


@dataclass(frozen=True)
class Part:
    name: str                   # the tensor's name in the file (with the layout's optional prefix)
    shape: tuple[int, ...]      # its shape in the file
    rows: slice                 # the rows of our leaf it holds


@dataclass(frozen=True)
class Entry:
    leaf: str                   # our path
    parts: tuple[Part, ...]
    transpose: bool             # the file holds it [in, out]

    def from_file(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        pieces = [t.t() if self.transpose else t for t in tensors]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def to_file(self, t: torch.Tensor) -> Iterator[torch.Tensor]:
        for part in self.parts:
            piece = t[part.rows]
            yield piece.t() if self.transpose else piece


def _rows(spec: ModelSpec, leaf: Leaf, n: int) -> list[int]:
    if n == 1:
        return [leaf.shape[0]]
    if leaf.placement.dim != 0 or len(leaf.placement.segments) != n:
        raise ValueError(f"{leaf.path} is {n} Hugging Face tensors, but its placement does not split its rows "
                         f"into {n} segments")
    return spec.segment_rows(leaf)


def table(cfg: Any) -> list[Entry]:
    """The family's name table for ``cfg``, in the order of the spec's leaves (the order ``init_stream`` gives)."""
    spec = model_spec(cfg)
    names = {n.ours: n for n in family_of(cfg).hf.names(spec)}  # built from the leaves: one for each
    entries = []
    for leaf in spec.leaves:
        n = names[leaf.path]
        parts, start = [], 0
        for hf, rows in zip(n.hf, _rows(spec, leaf, len(n.hf))):
            shape = (rows, *leaf.shape[1:])
            parts.append(Part(hf, tuple(reversed(shape)) if n.transpose else shape, slice(start, start + rows)))
            start += rows
        entries.append(Entry(leaf.path, tuple(parts), n.transpose))
    return entries


def describe(spec: ModelSpec) -> str:
    """How an error names the model a checkpoint was expected to be."""
    return f"{spec.family} model of {spec.n_layer} layers x {spec.costs.width} wide"
