"""An adapted model's frozen base (``Leaf.trainable`` False): on the compute device in the compute dtype, by
unit, outside every optimizer. The trainable leaves are what the carriers get (``trainable``); a trainer puts
both into a unit's tree, the frozen ones with no gradient. A spec with no frozen leaf holds nothing here.
"""
from __future__ import annotations

import torch

from nanotrain.core.models.spec import ModelSpec
from nanotrain.core.tree import Tree, named_leaves, set_path


def trainable(spec: ModelSpec, params: Tree) -> Tree:
    """``params`` less its frozen leaves (the same tensors): what an optimizer takes. ``params`` itself when
    nothing is frozen."""
    if not spec.frozen:
        return params
    out: dict = {}
    for path, t in named_leaves(params):
        if spec.leaf(path).trainable:
            head, _, rest = path.partition(".")
            if head == "blocks":
                out.setdefault("blocks", [{} for _ in range(spec.n_layer)])
            set_path(out, path, t)
    return out


class FrozenBase:
    """The frozen leaves of ``params``, cast to ``dtype`` on ``device`` once (a frozen leaf's fp32 original is
    then free to go)."""

    def __init__(self, spec: ModelSpec, params: Tree, device: torch.device, dtype: torch.dtype):
        leaves = dict(named_leaves(params)) if spec.frozen else {}
        self.paths = {unit.name: [p for p in unit.paths if not spec.leaf(p).trainable] for unit in spec.units}
        self.store = {p: leaves[p].detach().to(device, dtype) for paths in self.paths.values() for p in paths}

    def leaves(self, unit: str) -> list[tuple[str, torch.Tensor]]:
        """``unit``'s frozen leaves as (path, tensor), in the unit's order."""
        return [(p, self.store[p]) for p in self.paths[unit]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.store.values())
