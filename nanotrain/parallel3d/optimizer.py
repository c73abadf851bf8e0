"""nanotrain's AdamW on a 3D rank: ``optim.OffloadAdam`` over this rank's leaves (its stages, its TP shard).

That brings the house optimizer's options to tensor x pipeline x data parallelism: 8-bit moments
(``OffloadConfig.state_bits``), fp32 masters under low-precision compute (``OffloadConfig.dtype``
equal to the dtype the model was built in, ``build_3d(dtype=...)``), masters and moments in host
memory (``offload``). The model then computes with the optimizer's device weights, which replace
the pipeline's leaves.

- ``zero=0`` (DDP): every rank of the DP group updates all its leaves from the whole summed
  gradient. Masters and moments are per leaf, so with 8-bit moments each leaf is quantized in
  blocks from its start as in one process (a TP shard is quantized as a leaf of its own).
- ``zero=1`` (ZeRO-1): the gradient sync reduce-scatters (``GradSync.shard_gradients``); each
  rank keeps masters and moments of its shard of every bucket only, updates it, and the updated
  shards are all-gathered into flat per-bucket weights, of which the model's leaves are views.
  Optimizer memory per rank is divided by dp. The shard is cut at leaf boundaries into pieces,
  each a tensor of the inner optimizer: 8-bit blocks never mix two leaves (a LayerNorm's scale
  beside a matrix's), and a piece too small for 8 bits keeps 32-bit moments, as a small leaf does.

``step`` runs after ``grads_3d`` (the reductions are done): like ``torch.optim.AdamW.step``.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from nanotrain.data_parallel import comms
from nanotrain.data_parallel.buckets import Bucket
from nanotrain.optim import AdamConfig, OffloadAdam, OffloadConfig
from nanotrain.optim.offload import resolve_device
from nanotrain.parallel3d.step import Parallel3D
from nanotrain.tree import set_path


def shard_pieces(b: Bucket, rank: int) -> list[tuple[str, int, int]]:
    """The parts of ``b``'s leaves that fall in ``rank``'s shard, as (path, start, end) within the shard."""
    lo, hi = b.shard_range(rank)
    out = []
    for path, shape, offset in zip(b.paths, b.shapes, b.offsets):
        start, end = max(lo, offset), min(hi, offset + shape.numel())
        if start < end:
            out.append((path, start - lo, end - lo))
    return out


class Adam3D:
    """AdamW over ``p3d``'s leaves on this rank, replicated (``zero=0``) or sharded (``zero=1``) over DP."""

    def __init__(self, p3d: Parallel3D, hp: AdamConfig, ocfg: OffloadConfig, zero: int = 0):
        if zero not in (0, 1):
            raise ValueError(f"zero stage {zero} is not one the 3D engine runs: use 0 (DDP) or 1 (ZeRO-1)")
        pipe, sync = p3d.pipe, p3d.sync
        self.sync, self.zero = sync, zero
        leaves = {path: t.detach() for path, t in pipe.named_parameters()}
        first = next(iter(leaves.values()))
        if ocfg.dtype != first.dtype or resolve_device(ocfg) != first.device:
            raise ValueError(f"the model computes in {first.dtype} on {first.device} but the optimizer's weights would "
                             f"be {ocfg.dtype} on {ocfg.device}; make OffloadConfig's dtype and device build_3d's")
        if zero == 0:
            self.names = {path: f"p{i}" for i, path in enumerate(leaves)}  # OffloadAdam's tree: flat, no dots
            units = {b.name: [self.names[p] for p in b.paths] for b in sync.buckets}
            keep = tuple(self.names[p] for p in ocfg.keep_32bit if p in self.names)
            self.inner = OffloadAdam({self.names[p]: t for p, t in leaves.items()}, units, hp,
                                     replace(ocfg, keep_32bit=keep), copy=False)
            for path, name in self.names.items():
                set_path(pipe.params, path, self.inner.params[name].requires_grad_())
            return
        sync.shard_gradients()
        self.pieces = {b.name: shard_pieces(b, sync.rank) for b in sync.buckets}
        masters, units, keep = {}, {}, []
        for b in sync.buckets:
            # a copy: the masters are views of it, and a view of the whole bucket would keep all of it alive
            shard = b.flatten(leaves, torch.float32, first.device)[slice(*b.shard_range(sync.rank))].clone()
            for i, (path, lo, hi) in enumerate(self.pieces[b.name]):
                masters[f"{b.name}_{i}"] = shard[lo:hi]
                units.setdefault(b.name, []).append(f"{b.name}_{i}")
                keep += [f"{b.name}_{i}"] if path in ocfg.keep_32bit else []
        self.inner = OffloadAdam(masters, units, hp, replace(ocfg, keep_32bit=tuple(keep)), copy=False)
        self.weights = {b.name: b.flatten(leaves, first.dtype, first.device) for b in sync.buckets}
        self.send = {b.name: torch.zeros(b.shard, dtype=first.dtype, device=first.device) for b in sync.buckets}
        for b in sync.buckets:
            for path, view in b.views(self.weights[b.name]).items():
                set_path(pipe.params, path, view.requires_grad_())

    @property
    def hp(self) -> AdamConfig:
        return self.inner.hp

    def set_lr(self, lr: float) -> None:
        self.inner.set_lr(lr)

    def step(self) -> None:
        """Update from the reduced gradients; with ZeRO-1, all-gather the new shards into every rank's weights."""
        sync = self.sync
        with torch.no_grad():  # the device weights are leaves that require grad
            for b in sync.buckets:
                if self.zero:
                    shard = sync.grad_shard(b)
                    grads = [shard[lo:hi] for _, lo, hi in self.pieces[b.name]]
                else:
                    views = b.views(sync.grads[b.name])
                    grads = [views[p] for p in b.paths]
                if grads:
                    self.inner.grads_ready(b.name, grads)
            if not self.zero:
                for b in sync.buckets:
                    self.inner.wait_params(b.name)
                return
            self._gather()

    def _gather(self) -> None:
        """ZeRO-1: every rank's new shards (the inner optimizer's device weights) into every rank's flat weights."""
        sync, works = self.sync, []
        for b in sync.buckets:
            shard = self.send[b.name]
            new = self.inner.wait_params(b.name) if self.pieces[b.name] else []
            for (_, lo, hi), piece in zip(self.pieces[b.name], new, strict=True):
                shard[lo:hi].copy_(piece)
            if sync.world == 1:
                self.weights[b.name].copy_(shard)
            else:
                works.append(comms.all_gather_async(self.weights[b.name], shard, sync.group))
        for work in works:
            work.wait()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Masters and moments as ``OffloadAdam`` names them: by leaf path (``master.<path>``, ...) under DDP;
        under ZeRO-1 this rank's shard, by piece (``master.<bucket>_<i>``: the i-th of ``shard_pieces(bucket,
        dp rank)``), which only a run of the same buckets and dp reads back (``parallel3d.checkpoint``)."""
        if self.zero:
            return self.inner.state_dict()
        back = {name: path for path, name in self.names.items()}
        out = {}
        for key, t in self.inner.state_dict().items():
            kind, _, name = key.partition(".")
            out[f"{kind}.{back[name]}" if name else key] = t
        return out

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """What ``state_dict`` gave; the device weights are refreshed from the masters (under ZeRO-1 by the
        same all-gather as a step's: every rank of the DP group calls this together)."""
        mine = sd
        if not self.zero:
            mine = {}
            for key, t in sd.items():
                kind, _, path = key.partition(".")
                mine[f"{kind}.{self.names[path]}" if path else key] = t
        with torch.no_grad():  # the device weights are leaves that require grad
            self.inner.load_state_dict(mine)
            if self.zero:
                self._gather()

    def close(self) -> None:
        self.inner.close()
