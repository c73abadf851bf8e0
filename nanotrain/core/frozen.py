"""An adapted model's frozen base (``Leaf.trainable`` False): on the compute device in the compute dtype (or NF4), by
unit, outside every optimizer. The trainable leaves are what the carriers get (``trainable``); a trainer puts
both into a unit's tree, the frozen ones with no gradient. A spec with no frozen leaf holds nothing here. Both take
the model's leaves as they come (``core.leaves``): the base's are read one at a time, straight to the device.
"""
from __future__ import annotations

import torch

from nanotrain.core.leaves import Leaves, Start, as_leaves
from nanotrain.core.models.spec import ModelSpec
from nanotrain.core.nf4 import NF4Tensor, quantize_nf4
from nanotrain.core.tree import Tree, set_path


def trainable(spec: ModelSpec, leaves: Leaves, home: torch.device = torch.device("cpu")) -> Tree:
    """The trainable leaves read into a tree, fp32 on ``home`` (a tree's own tensors where they are that already):
    what an optimizer takes. ``home`` is where its masters live, so that masters on the GPU pass through host
    memory a leaf at a time (read on the host, the whole fp32 model held there was 4.6 GiB for llama-3.2-1b)."""
    out: dict = {}
    for leaf in spec.leaves:
        if leaf.trainable:
            if leaf.path.startswith("blocks."):
                out.setdefault("blocks", [{} for _ in range(spec.n_layer)])
            set_path(out, leaf.path, leaves.read(leaf.path).to(home, torch.float32))
    return out


def quantized(spec: ModelSpec, path: str) -> bool:
    """Whether a frozen leaf goes to NF4 under ``base_bits=4``: the blocks' matrices (QLoRA's choice: norms, biases,
    the embedding and the head stay in the compute dtype)."""
    leaf = spec.leaf(path)
    return not leaf.trainable and len(leaf.shape) == 2 and path.startswith("blocks.")


def frozen_paths(spec: ModelSpec, bits: int) -> tuple[frozenset[str], frozenset[str]]:
    """The frozen leaves, and those of them kept in NF4 under ``bits``."""
    frozen = frozenset(leaf.path for leaf in spec.leaves if not leaf.trainable)
    return frozen, frozenset(p for p in frozen if bits == 4 and quantized(spec, p))


def frozen_copy(spec: ModelSpec, path: str, t: torch.Tensor, device: torch.device, dtype: torch.dtype,
                bits: int) -> torch.Tensor | NF4Tensor:
    """A frozen leaf as it is kept on ``device``: cast to ``dtype``, or a block's matrix in NF4 (quantised there)."""
    if bits == 4 and quantized(spec, path):
        return quantize_nf4(t.detach().to(device))
    return t.detach().to(device, dtype)


class FrozenBase:
    """The frozen leaves of ``params`` (leaves, or a tree they are taken from) on ``device`` once, in ``dtype`` or
    (``bits=4``) the blocks' matrices in NF4, dequantised at each matmul; each read when its copy is made and let go
    of then."""

    def __init__(self, spec: ModelSpec, params: Start, device: torch.device, dtype: torch.dtype, bits: int = 16):
        leaves = as_leaves(params)
        self.paths = {unit.name: [p for p in unit.paths if not spec.leaf(p).trainable] for unit in spec.units}
        self.store = {p: frozen_copy(spec, p, leaves.read(p), device, dtype, bits)
                      for paths in self.paths.values() for p in paths}

    def leaves(self, unit: str) -> list[tuple[str, torch.Tensor | NF4Tensor]]:
        """``unit``'s frozen leaves as (path, tensor), in the unit's order."""
        return [(p, self.store[p]) for p in self.paths[unit]]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes if isinstance(t, NF4Tensor) else t.numel() * t.element_size() for t in self.store.values())
