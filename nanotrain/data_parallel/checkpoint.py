"""Sharded checkpoints for ZeRO: each rank writes its own shard; any world size resumes.

    step-000100/
      manifest.json                        world size, ZeRO stage, bucket layout, step, data position
      shard-00000-of-00003.safetensors     rank 0's masters and moments: one flat shard per bucket
      ...

No rank ever holds more than its shard while saving. The folder is written under a temporary
name, flushed, and published by the first rank once every rank has written (a barrier between)
through ``train.run_dir``, as ``train.state`` does for one process: a crash or power loss at any
moment leaves ``latest`` on a complete checkpoint. Resuming at the saved world size and layout reads only the
rank's own file; otherwise each rank puts the saved shards back together into the single-process
state (``shards.py``) and cuts its new shard out of it, so a run saved at 3 ranks resumes at 2, or
as one process (``single_process_state``). ``consolidate`` writes the HF-layout model file.
"""
from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from nanotrain.data import DataPosition
from nanotrain.data_parallel.buckets import Bucket
from nanotrain.data_parallel.shards import COUNTS, KINDS, shard_state
from nanotrain.data_parallel.trainer import DataParallelTrainer
from nanotrain.train.disk import check_space, write_tensors
from nanotrain.train.run_dir import fsync_path, prune, publish, remove_stale, write_durably
from nanotrain.train.scaler import KEYS as SCALER_KEYS, split_state
from nanotrain.train.schedule import LRSchedule
from nanotrain.train.step import Trainer, masters_tree
from weights import hf_config, save_hf
from weights.safetensors_io import CheckpointError, SafetensorsReader

MANIFEST = "manifest.json"


def _shard_file(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def _layout(buckets: list[Bucket]) -> list[dict]:
    return [{"name": b.name, "units": list(b.units), "paths": list(b.paths), "shapes": [list(s) for s in b.shapes],
             "offsets": list(b.offsets), "numel": b.numel, "padded": b.padded} for b in buckets]


def _buckets(manifest: dict) -> list[Bucket]:
    return [Bucket(d["name"], tuple(d["units"]), tuple(d["paths"]), tuple(torch.Size(s) for s in d["shapes"]),
                   tuple(d["offsets"]), d["numel"], d["padded"], manifest["world"]) for d in manifest["layout"]]


def is_sharded(ckpt: str | Path) -> bool:
    return (Path(ckpt) / MANIFEST).is_file()


def save_sharded(run_dir: str | Path, trainer: DataParallelTrainer, position: DataPosition,
                 meta: dict | None = None, schedule: LRSchedule | None = None, keep_last: int = 0) -> Path:
    """Every rank of the trainer's group calls this; returns the checkpoint folder. Published as
    ``train.state`` publishes (``train.run_dir``: flushed, renamed, ``latest`` moved last), with the
    same ``trainer.json`` and ``config.json``, so resume, fallback and retention treat it alike."""
    run_dir, group = Path(run_dir), trainer.group
    rank, world, step = trainer.rank, trainer.world, trainer.step_count
    final = run_dir / f"step-{step:06d}"
    name = [f".{final.name}.tmp-{os.getpid()}"]  # the first rank's process owns the temporary folder
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
    tmp = run_dir / name[0]
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=group)
    sd = trainer.shard_state_dict()
    check_space(run_dir, final.name, sum(t.numel() * t.element_size() for t in sd.values()), group)
    write_tensors(tmp / _shard_file(rank, world), [(k, tuple(t.shape), t.dtype) for k, t in sd.items()],
                  (t.cpu() for t in sd.values()))  # hashed as written (train.checksums)
    for f in (tmp / _shard_file(rank, world), tmp):
        fsync_path(f)
    dist.barrier(group=group)
    if rank == 0:
        manifest = {"format": "nanotrain-sharded-1", "world": world, "zero": trainer.dcfg.zero, "step": step,
                    "data_position": asdict(position), "layout": _layout(trainer.buckets), "meta": meta or {},
                    "files": [_shard_file(r, world) for r in range(world)]}
        state = {"step": step, "data_position": asdict(position), "meta": meta or {}, "sharded": True}
        if schedule is not None:
            state["lr_schedule"] = schedule.to_dict()
        write_durably(tmp / "config.json", json.dumps(hf_config(trainer.cfg), indent=2))
        write_durably(tmp / "trainer.json", json.dumps(state, indent=2))
        write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1))
        publish(run_dir, tmp, final)
        prune(run_dir, keep_last)
        remove_stale(run_dir)
    dist.barrier(group=group)  # nobody goes on (or exits) before the checkpoint is complete
    return final


def _manifest(ckpt: Path) -> dict:
    manifest = json.loads((ckpt / MANIFEST).read_text())
    missing = [f for r in range(manifest["world"]) if not (ckpt / (f := _shard_file(r, manifest["world"]))).is_file()]
    if missing:
        raise CheckpointError(f"{ckpt} lacks {', '.join(missing[:3])}: the sharded checkpoint is incomplete; "
                              f"resume from an earlier one")
    return manifest


def _per_shard(ckpt: Path, manifest: dict) -> CheckpointError:
    return CheckpointError(f"{ckpt} holds 8-bit moments, quantized per shard: it resumes only at its own world size "
                           f"({manifest['world']}) and ZeRO stage ({manifest['zero']})")


def check_world(ckpt: str | Path, world: int) -> None:
    """Refuse a sharded checkpoint that cannot resume at ``world`` ranks before any rank starts (8-bit moments)."""
    ckpt = Path(ckpt)
    manifest = _manifest(ckpt)
    if manifest["world"] != world:
        with SafetensorsReader(ckpt / _shard_file(0, manifest["world"])) as reader:
            if any("absmax" in k for k in reader.keys()):
                raise _per_shard(ckpt, manifest)


def single_process_state(ckpt: str | Path, kinds: tuple[str, ...] = KINDS) -> dict[str, torch.Tensor]:
    """The single-process optimizer state (``master.<path>``, ...) put back together from every shard (with
    8-bit moments, the masters only)."""
    ckpt = Path(ckpt)
    manifest = _manifest(ckpt)
    world = manifest["world"]
    with ExitStack() as stack:
        readers = [stack.enter_context(SafetensorsReader(ckpt / _shard_file(r, world))) for r in range(world)]
        if set(kinds) != {"master"} and any("absmax" in k for k in readers[0].keys()):
            raise _per_shard(ckpt, manifest)
        out = {k: readers[0].get(k) for k in COUNTS + SCALER_KEYS if k in readers[0].keys()}
        for b in _buckets(manifest):
            for kind in kinds:
                full = torch.cat([r.get(f"{kind}.{b.name}") for r in readers])
                out.update({f"{kind}.{p}": v for p, v in b.views(full).items()})
    return out


def load_masters(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights by tree path (what a trainer is rebuilt from)."""
    return {k.removeprefix("master."): t for k, t in single_process_state(ckpt, ("master",)).items()
            if k.startswith("master.")}


def restore_sharded(trainer: DataParallelTrainer, ckpt: str | Path) -> DataPosition:
    """Load this rank's shard (resharding when the world size or layout differ) and the step."""
    ckpt = Path(ckpt)
    manifest = _manifest(ckpt)
    if manifest["world"] == trainer.world and manifest["layout"] == _layout(trainer.buckets):
        trainer.load_shard_state_dict(load_file(ckpt / _shard_file(trainer.rank, trainer.world)))
    else:
        state, scaler = split_state(single_process_state(ckpt))
        trainer.load_shard_state_dict(shard_state(state, trainer.buckets, trainer.rank) | scaler)
    trainer.step_count = int(manifest["step"])
    return DataPosition(**manifest["data_position"])


def restore_any(trainer: Trainer, ckpt: str | Path) -> DataPosition:
    """A sharded checkpoint into any trainer: as shards under ZeRO, else as the whole state (DDP, one process)."""
    if isinstance(trainer, DataParallelTrainer) and trainer.dcfg.zero:
        return restore_sharded(trainer, ckpt)
    trainer.load_state_dict(single_process_state(ckpt))
    manifest = _manifest(Path(ckpt))
    trainer.step_count = int(manifest["step"])
    return DataPosition(**manifest["data_position"])


def consolidate(ckpt: str | Path, cfg: Any, out_dir: str | Path) -> Path:
    """Write the checkpoint's weights as a Hugging Face folder (safetensors and config.json) in ``out_dir``."""
    return save_hf(masters_tree(cfg, {f"master.{p}": t for p, t in load_masters(ckpt).items()}), cfg, out_dir)
