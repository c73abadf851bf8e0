"""Between the sharded optimizer state of ZeRO and the single-process checkpoint format.

A ZeRO rank's inner optimizer holds, per bucket, one flat shard of masters and moments. Saving
gathers the shards and cuts them back into the single-process entries (``master.<path>``, ...),
so a checkpoint does not depend on the world size it was saved at: loading cuts each rank's shard
out of the whole, which reshards to any world size.
"""
from __future__ import annotations

import torch

from nanotrain.data_parallel import comms
from nanotrain.data_parallel.buckets import Bucket
from nanotrain.distributed import Group

KINDS = ("master", "exp_avg", "exp_avg_sq")
COUNTS = ("steps", "skipped_steps")


def _refuse_8bit(keys) -> None:
    if any("absmax" in k for k in keys):
        raise ValueError("8-bit moments are quantized per shard under ZeRO and cannot be moved between the "
                         "single-process and the sharded layout yet; use 32-bit moments or zero stage 0")


def consolidate(shard_sd: dict[str, torch.Tensor], buckets: list[Bucket], group: Group, device: torch.device,
                root: bool) -> dict[str, torch.Tensor]:
    """The single-process state dict from every rank's ``shard_sd`` (collective), on ``root`` only ({} elsewhere)."""
    _refuse_8bit(shard_sd)
    out = {k: shard_sd[k] for k in COUNTS} if root else {}
    for b in buckets:
        full = {kind: comms.gather_flat(shard_sd[f"{kind}.{b.name}"], group, device) for kind in KINDS}
        if not root:
            continue
        views = {kind: b.views(t.cpu()) for kind, t in full.items()}
        for path in b.paths:
            out.update({f"{kind}.{path}": views[kind][path] for kind in KINDS})
    return out


def shard_state(sd: dict[str, torch.Tensor], buckets: list[Bucket], rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard state dict cut out of the single-process state dict ``sd``."""
    _refuse_8bit(sd)
    expected = {f"{kind}.{p}": s for b in buckets for p, s in zip(b.paths, b.shapes) for kind in KINDS}
    wanted = set(expected) | set(COUNTS)
    if set(sd) != wanted:
        missing, extra = sorted(wanted - set(sd)), sorted(set(sd) - wanted)
        raise ValueError(f"optimizer checkpoint does not match this model: missing {missing[:5]}, unexpected "
                         f"{extra[:5]}; was it saved from another model?")
    for key, shape in expected.items():
        if sd[key].shape != shape:
            raise ValueError(f"optimizer checkpoint entry {key!r} is {tuple(sd[key].shape)}, expected {tuple(shape)}; "
                             f"was it saved from another model?")
    out = {k: sd[k] for k in COUNTS}
    for b in buckets:
        lo, hi = b.shard_range(rank)
        for kind in KINDS:
            out[f"{kind}.{b.name}"] = b.flatten({p: sd[f"{kind}.{p}"] for p in b.paths})[lo:hi].clone()
    return out
