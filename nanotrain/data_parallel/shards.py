"""A rank's masters and moments: its pieces of every bucket's shard, in one ``OffloadAdam``.

A bucket's shard (``buckets.py``) is cut at the parameters' bounds into pieces (``rank_pieces``), each a
tensor of this rank's ``OffloadAdam``, one unit per bucket. A piece has the moment bits its parameter has
in one process (32 for small tensors and ``keep_32bit``), and with 8-bit moments every parameter and every
shard starts at a multiple of the quantization block (``plan_buckets(align=block)``): each block of moments
lies in one piece and is the block one process quantizes, so the update is the single-process one (up to
the order of the gradient's sums) and the pieces resume at any world size (``slices.py``). Buckets laid
out for one rank (DDP: ``world=1``) give every rank whole parameters as its pieces.

``whole_state`` and ``whole_entries`` go between the pieces and the single-process state (``master.<path>``,
...): a run saved in that format resumes sharded at any world size, and a sharded run saves in it.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist

from nanotrain.data_parallel import comms
from nanotrain.data_parallel.buckets import Bucket, Piece, cut, rank_pieces
from nanotrain.checkpoint.slices import read_entries, span
from nanotrain.core.leaves import Leaves
from nanotrain.core.train.shard import COUNTS, SCALARS, TP, ShardState, moment_block
from nanotrain.distributed import Group
from nanotrain.core.optim import AdamConfig, OffloadAdam, OffloadConfig
from nanotrain.core.optim.carrier import Wraps
from nanotrain.core.optim.units import resolve_device
KINDS = ("master", "exp_avg", "exp_avg_sq")
Layout = list[tuple[Bucket, list[Piece]]]  # each bucket with this rank's pieces of it


class ShardedAdam(Wraps):
    """``OffloadAdam`` over this rank's pieces of ``buckets``, fed one bucket's reduced gradient at a time.

    ``leaves`` become the masters, each read once in ``units``' order (``take``) and cut to this rank's piece of
    it at once (fp32, where the masters live), so the rank never holds more of the model than its pieces and the
    leaf in flight: a whole fp32 leaf there is taken over as its master unless ``copy``. ``whole`` (by path): where
    each leaf is also written whole as it passes (ZeRO-1/2's compute-dtype weights, gathered into after each step).
    ``sharded``: the buckets are laid out for ``group`` and this rank holds its shard of each; else (``world=1``
    buckets) every rank of ``group`` holds them whole, and the first writes them. ``send`` (sharded, by bucket):
    where this rank's compute-dtype shard lives, given (ZeRO-3 holding its weights: its slice of the gathered
    unit, so the all-gather runs in place); else allocated here.
    """

    def __init__(self, leaves: Leaves, units: dict[str, list[str]], buckets: list[Bucket], hp: AdamConfig,
                 ocfg: OffloadConfig, group: Group, sharded: bool, copy: bool = False,
                 whole: dict[str, torch.Tensor] | None = None, send: dict[str, torch.Tensor] | None = None):
        self.group, self.sharded = group, sharded
        self.rank = dist.get_rank(group)
        self.block = moment_block(ocfg)
        self.pieces = {b.name: rank_pieces(b, self.rank if sharded else 0) for b in buckets}
        self.layout = [(b, self.pieces[b.name]) for b in buckets]
        self.device = resolve_device(ocfg)
        home = torch.device("cpu") if ocfg.offload else self.device  # where the masters live
        mine = {p.path: p for _, pieces in self.layout for p in pieces}  # a parameter's one piece in this rank's shard
        taken: dict[str, torch.Tensor] = {}

        def keep(path: str, t: torch.Tensor) -> None:
            if whole is not None:
                whole[path].copy_(t)
            if path in mine:
                p, flat = mine[path], t.reshape(-1)
                # a part is copied, so the leaf's memory goes with the leaf; a whole fp32 leaf where the masters live
                # (a tree's, as loaded) is taken over as its master by the optimizer unless ``copy``
                taken[p.name] = (flat.to(home, torch.float32) if p.hi - p.lo == flat.numel() else
                                 flat[p.start:p.stop].to(home, torch.float32, copy=True))

        take(leaves, units, group, self.device, keep)
        tensors = {p.name: taken[p.name] for _, pieces in self.layout for p in pieces}
        units = {b.name: [p.name for p in pieces] for b, pieces in self.layout if pieces}
        # each bucket's all-gather input: this rank's new weights, flat with zero padding, where the optimizer keeps
        # its pieces' device weights (so the shard is held once in the compute dtype and gathered without a copy)
        self._send = {b.name: send[b.name].zero_() if send else torch.zeros(b.shard, dtype=ocfg.dtype,
                                                                             device=self.device)
                      for b in buckets} if sharded else {}
        into = {p.name: self._send[b.name][p.lo:p.hi] for b, pieces in self.layout for p in pieces} if sharded else None
        self.inner = OffloadAdam(tensors, units, hp, pieces_config(ocfg, self.layout), copy=copy, device_weights=into)

    def update(self, b: Bucket, reduced: torch.Tensor) -> None:
        """``reduced``: this rank's shard of ``b``'s summed gradient (with ``world=1`` buckets, all of it)."""
        if self.pieces[b.name]:
            self.inner.update(b.name, cut(reduced, self.pieces[b.name]))

    def weights(self, b: Bucket) -> list[torch.Tensor]:
        """The pieces' device weights (flat, in the compute dtype), safe to use on the current stream."""
        return self.inner.weights(b.name) if self.pieces[b.name] else []

    def new_shard(self, b: Bucket) -> torch.Tensor:
        """This rank's shard of ``b``'s updated weights, flat with zero padding, to all-gather: the optimizer's own
        device weights (once their update is done, on the current stream)."""
        self.weights(b)
        return self._send[b.name]

    # -- checkpoints --------------------------------------------------------------------------

    def shard_state(self, tp: TP = None) -> ShardState:
        """Masters and moments by piece (``master.<piece>``, ...): what this rank writes of a sharded checkpoint."""
        pieces = [p for _, ps in self.layout for p in ps]
        replica = not self.sharded and self.rank != 0  # DDP: the first rank writes for all
        return ShardState(pieces, self.inner.state_dict(), self.block, tp,
                          frozenset(p.name for p in pieces) if replica else frozenset())

    def load_shard_state(self, entries: dict[str, torch.Tensor]) -> None:
        self.inner.load_state_dict(entries)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The single-process state; sharded, gathered (collective) onto the first rank ({} elsewhere)."""
        return whole_state(self.inner.state_dict(), self.layout, self.group if self.sharded else None, self.device,
                           self.rank == 0)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load the single-process state (the same on every rank), saved at any world size."""
        self.load_shard_state(whole_entries(self.shard_state(), sd))


def take(leaves: Leaves, units: dict[str, list[str]], group: Group, device: torch.device,
         keep: Callable[[str, torch.Tensor], None]) -> None:
    """Each leaf of ``units`` read in their order (a seed draws them in it), moved to ``device`` in the dtype it is
    read in, made the group's first rank's (every rank of a run reads the same leaves; trees a caller built per rank
    may differ) and handed to ``keep``, then let go of before the next is read."""
    for paths in units.values():
        for path in paths:
            t = leaves.read(path).to(device).contiguous()
            comms.broadcast_from_first([t], group, device)
            keep(path, t)


def pieces_config(ocfg: OffloadConfig, layout: Layout) -> OffloadConfig:
    """``ocfg`` for an optimizer over ``layout``'s pieces: each has the moment bits its parameter has in one process."""
    keep = [p.name for b, pieces in layout for p in pieces if ocfg.moment_bits(p.path, b.shape(p.path).numel()) == 32]
    return replace(ocfg, keep_32bit=tuple(keep), min_8bit_numel=0)


def whole_entries(state: ShardState, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state``'s entries read from the single-process state ``sd``, saved at any world size."""
    return read_entries(state, WholeSource(sd, state.block))


def whole_state(state: dict[str, torch.Tensor], layout: Layout, group: Group | None, device: torch.device,
                root: bool) -> dict[str, torch.Tensor]:
    """The single-process state from every rank's ``state`` by piece (collective over ``group``), on ``root``
    only ({} elsewhere); ``group=None``: the pieces are whole parameters held alike by every rank, renamed."""
    names = {p.name: (p.path, b.shape(p.path)) for b, pieces in layout for p in pieces}
    out = {k: state[k] for k in COUNTS}
    if group is None:
        for key, t in state.items():
            kind, _, name = key.partition(".")
            if name in names:
                path, shape = names[name]
                out[f"{kind}.{path}"] = t.view(shape) if kind in KINDS else t
        return out
    if any("_absmax." in k for k in state):
        raise ValueError("8-bit moments under ZeRO are quantized per piece: they are saved by piece "
                         "(``shard_state``), never gathered whole")
    for b, pieces in layout:
        for kind in KINDS:
            shard = torch.zeros(b.shard)
            for p in pieces:
                shard[p.lo:p.hi] = state[f"{kind}.{p.name}"]
            full = comms.gather_flat(shard, group, device)
            if root:
                out.update({f"{kind}.{path}": v for path, v in b.views(full.cpu()).items()})
    return out if root else {}


class WholeSource:
    """The single-process state ``sd`` as ``slices.read_entries``' source: every leaf whole, no TP."""

    def __init__(self, sd: dict[str, torch.Tensor], block: int | None):
        self.sd, self.block = sd, block

    def scalars(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.sd.items() if k in SCALARS}

    def read(self, kind: str, piece: Piece, tp: TP, like: torch.Tensor) -> torch.Tensor:
        key = f"{kind}.{piece.path}"
        if key not in self.sd:
            raise ValueError(f"optimizer checkpoint lacks {key!r}: was it saved from another model, or with other "
                             f"--adam-bits?")
        lo, hi = span(kind, piece.start, piece.stop, self.block)
        return self.sd[key].reshape(-1)[lo:hi]
