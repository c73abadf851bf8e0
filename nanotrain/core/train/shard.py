"""A trainer's shard of its state: the pieces of leaves it holds, what every checkpoint writes and reads back.

Every trainer offers its shard (``Trainer.shard_state``): one process holds one shard of whole leaves
(``whole_shard``), a ZeRO rank flat ranges of its leaves, a tensor-parallel rank its cut of them.
``checkpoint/`` writes every shard by one writer and reads any layout back by one reader
(``checkpoint.slices``), so a run resumes what a run of any layout saved.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

import torch

from nanotrain.core.models.spec import ModelSpec
from nanotrain.core.optim import OffloadConfig
from nanotrain.core.train.scaler import KEYS as SCALER_KEYS
from nanotrain.distributed import Group

TP = tuple[int, int] | None  # a rank's tensor-parallel shard (rank, size), or None: whole leaves
COUNTS = ("steps", "skipped_steps")
SCALARS = COUNTS + SCALER_KEYS  # the entries of a shard that are no piece's: the same on every rank


@dataclass(frozen=True)
class Piece:
    """A flat range of one parameter as a rank holds it: in its shard of a bucket (``data_parallel.buckets``), or
    the whole leaf."""
    name: str    # its name as a parameter of the shard's own optimizer
    path: str    # the model parameter it is part of
    start: int   # where in that parameter (flattened) it starts
    lo: int      # where in the shard it lies
    hi: int

    @property
    def stop(self) -> int:
        """Where in the parameter it ends."""
        return self.start + self.hi - self.lo


@dataclass
class ShardState:
    """A rank's part of a checkpoint: its pieces' entries, as its optimizer holds them (not copies)."""
    pieces: list[Piece]             # every piece it holds, entries ``<kind>.<piece name>`` of ``entries``
    entries: dict[str, torch.Tensor]  # and the step counts (fp16: the loss scaler's state)
    block: int | None = None        # 8-bit moments' block (None: 32-bit moments)
    tp: TP = None
    skip: frozenset[str] = field(default_factory=frozenset)  # pieces an equal copy on another rank writes
    group: Group | None = None      # the ranks that save a checkpoint together (None: this process alone)
    layout: dict = field(default_factory=dict)  # how the run lays out its state, as the manifest records it

    def written(self) -> list[Piece]:
        return [p for p in self.pieces if p.name not in self.skip]


def whole_shard(spec: ModelSpec, entries: dict[str, torch.Tensor], block: int | None) -> ShardState:
    """One process's state (``master.<path>``, ...) as one shard of whole leaves: each piece is named by its path.
    A frozen leaf (a base under adapters) has no state: the run's ``--weights`` hold it."""
    return ShardState([Piece(leaf.path, leaf.path, 0, 0, prod(leaf.shape)) for leaf in spec.leaves if leaf.trainable],
                      entries, block)


def moment_block(ocfg: OffloadConfig) -> int | None:
    """The 8-bit moments' quantization block, at a multiple of which every piece starts (None: 32-bit moments)."""
    return ocfg.block if ocfg.state_bits == 8 else None
