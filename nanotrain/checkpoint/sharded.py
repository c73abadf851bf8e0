"""Sharded checkpoints (``slices.py``'s format): each rank writes its own pieces; any layout resumes.

No rank ever holds more than its own state while saving. The folder is written under a temporary
name, flushed, and published by the group's first rank once every rank has written (a barrier
between) through ``checkpoint.run_dir``, as ``checkpoint.state`` does for one process: a crash or power loss at
any moment leaves ``latest`` on a complete checkpoint. Resuming reads, for each piece a rank now holds,
the saved pieces it overlaps: at the saved layout only the rank's own file, at another each rank what
it needs, so a data-parallel run saved at 3 ranks resumes at 2 or as one process, a 3D run at another
dp (and where the leaves allow, another tp or pp). ``consolidate`` writes the Hugging Face folder.

A trainer saved this way (``SlicedTrainer``: ``DataParallelTrainer``, ``Parallel3DTrainer``) has a
process ``group`` over which every rank saves, ``shard_state`` and ``load_shard_state``, and its
``layout`` for the manifest.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from math import prod
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from nanotrain.data import DataPosition
from nanotrain.checkpoint.slices import (FORMAT, MANIFEST, Piece, SCALARS, ShardState, SliceReader, check, read_entries,
                                            read_manifest)
from nanotrain.distributed import Group
from nanotrain.core.models.run import tree_from
from nanotrain.core.models.spec import ModelSpec
from nanotrain.checkpoint.disk import check_space, write_tensors
from nanotrain.checkpoint.run_dir import fsync_path, prune, publish, remove_stale, write_durably
from nanotrain.core.train.schedule import LRSchedule
from nanotrain.core.train.step import Trainer
from weights import hf_config, save_hf
from weights.safetensors_io import CheckpointError


class SlicedTrainer(Protocol):
    group: Group
    step_count: int
    cfg: Any
    spec: ModelSpec
    layout: dict

    def shard_state(self) -> ShardState: ...

    def load_shard_state(self, entries: dict[str, torch.Tensor]) -> None: ...


def is_sharded(ckpt: str | Path) -> bool:
    return (Path(ckpt) / MANIFEST).is_file() or (Path(ckpt) / "layout.json").is_file()


def save_sharded(run_dir: str | Path, trainer: SlicedTrainer, position: DataPosition | None = None,
                 meta: dict | None = None, schedule: LRSchedule | None = None, keep_last: int = 0) -> Path:
    """Every rank of the trainer's group calls this; returns the checkpoint folder. Published as
    ``checkpoint.state`` publishes (``checkpoint.run_dir``: flushed, renamed, ``latest`` moved last), with a
    ``trainer.json`` and ``config.json`` too, so resume, fallback and retention treat it alike."""
    run_dir, group, step = Path(run_dir), trainer.group, trainer.step_count
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    final = run_dir / f"step-{step:06d}"
    name = [f".{final.name}.tmp-{os.getpid()}"]  # the first rank's process owns the temporary folder
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
    tmp = run_dir / name[0]
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=group)
    state = trainer.shard_state()
    pieces, file = state.written(), f"shard-{rank:05d}-of-{world:05d}.safetensors"
    names = {p.name for p in pieces}
    keys = [k for k in state.entries if pieces and (k in SCALARS or k.partition(".")[2] in names)]
    check_space(run_dir, final.name, sum(state.entries[k].numel() * state.entries[k].element_size() for k in keys),
                group)
    if pieces:
        write_tensors(tmp / file, [(k, tuple(state.entries[k].shape), state.entries[k].dtype) for k in keys],
                      (state.entries[k].cpu() for k in keys))  # hashed as written (train.checksums)
        fsync_path(tmp / file)
    held = [None] * world
    dist.all_gather_object(held, {"file": file, "tp": state.tp, "pieces": [[p.name, p.path, p.start, p.stop]
                                                                           for p in pieces]} if pieces else None,
                           group=group)
    if rank == 0:
        shards = [h for h in held if h is not None]
        manifest = {"format": FORMAT, "step": step, "layout": trainer.layout, "block": state.block,
                    "scalars": [k for k in SCALARS if k in state.entries], "files": [s["file"] for s in shards],
                    "shards": shards}
        info = {"step": step, "data_position": position and asdict(position), "meta": meta or {}, "sharded": True}
        if schedule is not None:
            info["lr_schedule"] = schedule.to_dict()
        write_durably(tmp / "config.json", json.dumps(hf_config(trainer.cfg), indent=2))
        write_durably(tmp / "trainer.json", json.dumps(info, indent=2))
        write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1))
        publish(run_dir, tmp, final)
        prune(run_dir, keep_last)
        remove_stale(run_dir)
    dist.barrier(group=group)  # nobody goes on (or exits) before the checkpoint is complete
    return final


def check_resumable(ckpt: str | Path, tp: int | None = None, block: int | None = None) -> dict:
    """Refuse, before any rank starts, a checkpoint that cannot resume with whole leaves (``tp=None``) or
    ``tp`` tensor-parallel ranks: an old format (saying how to convert it), a missing file, 8-bit moments at
    another cut or ``block``. Returns the manifest."""
    manifest = read_manifest(ckpt)
    check(manifest, ckpt, tp, block)
    return manifest


def restore_sharded(trainer: SlicedTrainer, ckpt: str | Path) -> DataPosition | None:
    """Load this rank's pieces, from whichever saved pieces hold them, and the step; the data position."""
    state = trainer.shard_state()
    return _restore(trainer, ckpt, lambda reader: trainer.load_shard_state(read_entries(state, reader)))


def restore_whole(trainer: Trainer, ckpt: str | Path) -> DataPosition | None:
    """A sharded checkpoint into a one-process trainer: every leaf put back whole from its saved pieces."""
    whole = [Piece(path, path, 0, 0, prod(shape)) for path, shape in trainer.spec.shapes.items()]
    return _restore(trainer, ckpt, lambda reader: trainer.load_state_dict(
        read_entries(ShardState(whole, trainer.state_dict()), reader)))


def _restore(trainer: SlicedTrainer | Trainer, ckpt: str | Path, load: Callable[[SliceReader], None]
             ) -> DataPosition | None:
    with SliceReader(ckpt) as reader:
        if reader.spec.shapes != trainer.spec.shapes:
            raise CheckpointError(f"{reader.ckpt} holds another model than this run's ({reader.cfg}); resume with "
                                  f"that model")
        load(reader)
    trainer.step_count = int(reader.manifest["step"])
    saved = json.loads((Path(ckpt) / "trainer.json").read_text())["data_position"]
    return saved and DataPosition(**saved)


def load_masters(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights by tree path, whole (what a trainer is rebuilt from)."""
    with SliceReader(ckpt) as reader:
        return {path: reader.whole("master", path) for path in reader.spec.shapes}


def consolidate(ckpt: str | Path, cfg: Any, out_dir: str | Path) -> Path:
    """Write the checkpoint's fp32 masters as a Hugging Face folder in ``out_dir`` (the model: ``cfg``, or with
    None the checkpoint's own ``config.json``)."""
    with SliceReader(ckpt) as reader:
        masters = ((path, reader.whole("master", path)) for path in reader.spec.shapes)
        return save_hf(tree_from(reader.spec, masters), cfg or reader.cfg, out_dir)
