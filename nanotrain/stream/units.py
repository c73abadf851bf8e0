"""What streaming keeps of a unit: its masters and moments (and a frozen base) in one host arena (``HostUnit``), and
the device buffers that hold one unit at a time (``Slot``); the moments' tensors as they travel."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanotrain.core.nf4 import NF4Tensor
from nanotrain.core.optim.adam import AdamState, AdamState8, AdamState32, init_state
from nanotrain.core.optim.quant8 import n_blocks
from nanotrain.stream.pinned import HostArena


def state_tensors(s: AdamState) -> list[torch.Tensor]:
    """The tensors of a moment state, in a fixed order (what travels between host and device)."""
    if isinstance(s, AdamState8):
        return [s.exp_avg, s.exp_avg_absmax, s.exp_avg_sq, s.exp_avg_sq_absmax]
    return [s.exp_avg, s.exp_avg_sq]


def like_state(s: AdamState, make) -> AdamState:
    """A state of the same kind whose tensors are ``make(tensor)`` of ``s``'s."""
    ts = [make(t) for t in state_tensors(s)]
    return AdamState8(*ts, s.block) if isinstance(s, AdamState8) else AdamState32(*ts)


def state_sizes(n: int, bits: int, block: int) -> list[tuple[int, torch.dtype]]:
    """(elements, dtype) of each tensor of ``n`` elements' moments, in ``state_tensors`` order."""
    if bits == 32:
        return [(n, torch.float32)] * 2
    return [(n, torch.uint8), (n_blocks(n, block), torch.float32)] * 2


def zero_state(take, n: int, bits: int, block: int) -> AdamState:
    """``init_state``'s zero moments of ``n`` elements in tensors carved by ``take(numel, dtype)`` and
    filled in place: a unit's zeros built whole and then copied would be one more unit in host memory
    (4.2 GB for Llama-3.1-8B's head, whose moments are 32-bit)."""
    one = state_tensors(init_state(torch.empty(1), bits, block))  # each tensor's value at every element
    ts = [take(numel, dtype).fill_(t[0]) for (numel, dtype), t in zip(state_sizes(n, bits, block), one)]
    return AdamState8(*ts, block) if bits == 8 else AdamState32(*ts)


@dataclass
class HostUnit:
    name: str
    paths: list[str]
    shapes: list[torch.Size]
    arena: HostArena
    master: list[torch.Tensor]      # flat fp32 views into the arena
    state: list[AdamState]
    written: torch.cuda.Event | None = None  # its last update is back in host memory
    # A base under adapters: (the leaf's place among the unit's, its shape, its flat compute-dtype copy in the
    # arena) for each frozen leaf, which only travels; ``paths``, ``shapes``, ``master``, ``state``: the others'.
    base: list[tuple[int, torch.Size, torch.Tensor | NF4Tensor]] = field(default_factory=list)

    @property
    def layout(self) -> tuple:
        return (tuple((tuple(s), type(st).__name__) for s, st in zip(self.shapes, self.state)),
                tuple((i, tuple(s)) for i, s, _ in self.base))

    @property
    def trained_at(self) -> list[int]:
        """The places of the trained leaves among the unit's (all of them without a frozen base)."""
        frozen = {i for i, _, _ in self.base}
        return [i for i in range(len(self.shapes) + len(self.base)) if i not in frozen]

    @property
    def leaf_shapes(self) -> list[torch.Size]:
        """Every leaf's shape, in the unit's order."""
        shapes = dict(zip(self.trained_at, self.shapes)) | {i: s for i, s, _ in self.base}
        return [shapes[i] for i in range(len(shapes))]


@dataclass
class Slot:
    """Device buffers for one unit at a time."""
    layout: tuple
    master: list[torch.Tensor]
    state: list[AdamState]
    weights: list[torch.Tensor]     # compute dtype, shaped, every leaf of the unit (the trained take gradients)
    staged: bool = False            # masters and moments only pass through a staging buffer (``stream.staged``)
    current: bool = False           # staged: the weights are the unit's current masters, cast
    unit: HostUnit | None = None
    ready: torch.cuda.Event | None = None
    free: torch.cuda.Event | None = None
    # Whose current masters / moments the buffers hold: a unit loaded into the slot it was last
    # loaded or updated in (the embeddings in theirs, every step) needs no copy.
    master_of: HostUnit | None = None
    state_of: HostUnit | None = None


def host_parts(t: torch.Tensor | NF4Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors a frozen leaf travels as: itself, or a 4-bit one's codes and scales."""
    return t.parts if isinstance(t, NF4Tensor) else (t,)
