"""Saved 3D state: one file per (tp, pp) shard, under ZeRO-1 one more per rank; resumed at the same
layout, consolidated to one HF file.

A checkpoint is a folder ``step-NNNNNN`` holding ``tp{t}-pp{p}.safetensors`` (that shard's
parameters, and without ZeRO its optimizer state: AdamW moments as ``train.adapters.flat_state``
names them, or ``Adam3D``'s masters and moments by leaf path) and ``layout.json``, the manifest.
Data-parallel replicas hold equal weights, so only replica 0 writes the shard files. Under ZeRO-1
(``Adam3D(zero=1)``) each rank of a DP group holds other masters and moments: every rank also
writes ``tp{t}-pp{p}-dp{d}.safetensors`` with its shard of them (by piece, ``Adam3D.state_dict``),
and the manifest records each (tp, pp) shard's buckets (paths, shapes, offsets, padding), from
which ``optimizer.shard_pieces`` says which part of which leaf each piece is.

The folder is filled under a temporary name, flushed, and published by global rank 0 once every
writer has finished (``train.run_dir.publish``: renamed into place, ``latest`` moved last), so a
crash leaves the previous checkpoint whole. Batches are a pure function of the step, so the step
is all a resumed run needs to draw what the uninterrupted one would have.

``consolidate`` needs no process group: it reads the shards of a checkpoint and puts every leaf
back together (``tensor_parallel.shard.unshard_leaf``, by the spec of the manifest's family and
config), for ``weights.save_hf`` to write the single ``model.safetensors`` that ``transformers`` loads.
Where ``Adam3D`` saved fp32 masters (under ZeRO-1 in pieces over the dp ranks' files, placed by the
manifest's buckets), those are the leaves: a bf16 run exports its masters, not its rounded weights.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from nanotrain.data_parallel.buckets import Bucket
from nanotrain.models import FAMILIES, model_spec
from nanotrain.models.run import empty_tree
from nanotrain.parallel3d.optimizer import Adam3D, shard_pieces
from nanotrain.parallel3d.trainer import Parallel3DTrainer
from nanotrain.tensor_parallel.shard import unshard_leaf
from nanotrain.train.disk import write_tensors
from nanotrain.train.run_dir import fsync_path, named_by_latest, publish, remove_stale, write_durably
from nanotrain.tree import Tree, set_path
from weights import save_hf
from weights.safetensors_io import CheckpointError, SafetensorsReader


def optimizer_of(trainer: Parallel3DTrainer) -> str:
    """Which optimizer's state the shards hold (checkpoints from before ``Adam3D`` hold torch's)."""
    opt = trainer.opt
    if isinstance(opt, Adam3D):
        return f"Adam3D, {opt.inner.cfg.state_bits}-bit moments, {str(opt.inner.cfg.dtype).removeprefix('torch.')}"
    return type(opt).__name__


def zero_of(trainer: Parallel3DTrainer) -> int:
    return trainer.opt.zero if isinstance(trainer.opt, Adam3D) else 0


def layout_of(trainer: Parallel3DTrainer) -> dict:
    """What a resumed run must share with the saved one: the model, how it is cut, the optimizer (and
    under ZeRO-1 dp, since each rank's file holds its shard)."""
    p3d = trainer.p3d
    spec = p3d.plan.spec
    return {"family": spec.family, "config": vars(spec.cfg), "tp": p3d.grid.tp, "pp": p3d.grid.pp, "dp": p3d.grid.dp,
            "stages": [[layer.name for layer in spec.layers] for spec in p3d.pipe.specs],
            "sequence_parallel": p3d.plan.sequence_parallel, "seq_len": p3d.seq_len,
            "optimizer": optimizer_of(trainer), "zero": zero_of(trainer)}


def bucket_layout(buckets: list[Bucket]) -> list[dict]:
    return [{"name": b.name, "paths": list(b.paths), "shapes": [list(s) for s in b.shapes],
             "offsets": list(b.offsets), "numel": b.numel, "padded": b.padded} for b in buckets]


def shard_file(folder: Path, tp_rank: int, pp_rank: int) -> Path:
    return folder / f"tp{tp_rank}-pp{pp_rank}.safetensors"


def optimizer_file(folder: Path, tp_rank: int, pp_rank: int, dp_rank: int) -> Path:
    """A ZeRO-1 rank's shard of the masters and moments."""
    return folder / f"tp{tp_rank}-pp{pp_rank}-dp{dp_rank}.safetensors"


def _write(path: Path, sd: dict[str, torch.Tensor]) -> None:
    write_tensors(path, [(k, tuple(t.shape), t.dtype) for k, t in sd.items()], iter(sd.values()))  # hashed as written
    fsync_path(path)


def save_3d(run_dir: str | Path, trainer: Parallel3DTrainer) -> Path:
    """Every rank calls this at the same step; returns the checkpoint folder."""
    run_dir, grid, zero = Path(run_dir), trainer.p3d.grid, zero_of(trainer)
    final = run_dir / f"step-{trainer.step_count:06d}"
    name = [f".{final.name}.tmp-{os.getpid()}"]  # global rank 0's process owns the temporary folder
    dist.broadcast_object_list(name, src=0)
    tmp = run_dir / name[0]
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    sd = trainer.state_dict()
    params = {k: t for k, t in sd.items() if k.startswith("param.")}
    if grid.dp_rank == 0:
        _write(shard_file(tmp, grid.tp_rank, grid.pp_rank), params if zero else sd)
    if zero:
        _write(optimizer_file(tmp, grid.tp_rank, grid.pp_rank, grid.dp_rank),
               {k: t for k, t in sd.items() if k not in params})
    buckets = [None] * dist.get_world_size()
    dist.all_gather_object(buckets, (f"tp{grid.tp_rank}-pp{grid.pp_rank}", bucket_layout(trainer.p3d.sync.buckets)))
    if dist.get_rank() == 0:
        files = [shard_file(tmp, t, p).name for p in range(grid.pp) for t in range(grid.tp)]
        files += [optimizer_file(tmp, t, p, d).name for p in range(grid.pp) for t in range(grid.tp)
                  for d in range(grid.dp)] if zero else []
        manifest = {"step": trainer.step_count, **layout_of(trainer), "files": files}
        if zero:
            manifest["buckets"] = dict(sorted(buckets))
        write_durably(tmp / "layout.json", json.dumps(manifest, indent=1))
        publish(run_dir, tmp, final)
        remove_stale(run_dir)
    dist.barrier()  # nobody reads ``latest`` before it exists
    return final


def latest_3d(run_dir: str | Path) -> Path:
    named = named_by_latest(Path(run_dir))
    if named is None:
        raise CheckpointError(f"nothing to resume in {run_dir}: no 'latest' file; pass the run's --out folder")
    return named


def saved_layout(ckpt: str | Path) -> dict:
    """A checkpoint's manifest (``layout.json``), older ones' missing entries filled in."""
    path = Path(ckpt) / "layout.json"
    if not path.is_file():
        raise CheckpointError(f"{ckpt} has no layout.json: it is no 3D checkpoint, or an incomplete one")
    saved = json.loads(path.read_text())
    saved.setdefault("optimizer", "AdamW")
    saved.setdefault("family", "gpt2")  # the only family before there were several
    saved.setdefault("zero", 0)
    return saved


def check_layout(ckpt: str | Path, mine: dict) -> None:
    """Refuse to resume ``ckpt`` with another model, cut, optimizer, or under ZeRO-1 another dp (``mine``:
    ``layout_of``'s entries, or some of them, as ``tasks.train3d`` checks its flags before any process starts)."""
    saved = saved_layout(ckpt)
    wrong = [k for k in mine if (k != "dp" or mine.get("zero") or saved["zero"]) and saved.get(k) != mine[k]]
    if wrong:
        raise CheckpointError(f"{ckpt} was saved with another {wrong[0]} ({saved.get(wrong[0])} vs this run's "
                              f"{mine[wrong[0]]}); resume with the saved layout (tp {saved['tp']}, pp {saved['pp']}"
                              f"{', dp ' + str(saved['dp']) if saved['zero'] else ''}) and optimizer "
                              f"({saved['optimizer']}, zero {saved['zero']})")


def restore_3d(trainer: Parallel3DTrainer, ckpt: str | Path) -> None:
    """Load this rank's shard and its optimizer state, and the step, into a trainer of the same layout
    (every rank calls it: under ZeRO-1 the weights are all-gathered from the restored masters)."""
    ckpt, grid = Path(ckpt), trainer.p3d.grid
    mine = layout_of(trainer)
    check_layout(ckpt, mine)
    saved = saved_layout(ckpt)
    missing = [f for f in saved.get("files", ()) if not (ckpt / f).is_file()]
    if missing:
        raise CheckpointError(f"{ckpt} lacks {', '.join(missing[:3])}: the checkpoint is incomplete; resume from "
                              f"an earlier one")
    device = str(trainer.p3d.pipe.ctx.device)
    if not mine["zero"]:
        trainer.load_state_dict(load_file(shard_file(ckpt, grid.tp_rank, grid.pp_rank), device=device))
    else:  # the weights are all-gathered from the restored masters, as after a step
        key = f"tp{grid.tp_rank}-pp{grid.pp_rank}"
        if saved["buckets"][key] != bucket_layout(trainer.p3d.sync.buckets):
            raise CheckpointError(f"{ckpt} holds other gradient buckets for {key} than this run builds: it was saved "
                                  f"by another version of the 3D engine; resume it with that version")
        trainer.load_state_dict(load_file(optimizer_file(ckpt, grid.tp_rank, grid.pp_rank, grid.dp_rank), device))
    trainer.step_count = int(saved["step"])


def _zero_masters(ckpt: Path, layout: dict, t: int, p: int) -> dict[str, torch.Tensor]:
    """Shard (t, p)'s fp32 masters put back together from every dp rank's pieces (ZeRO-1)."""
    dp = layout["dp"]
    buckets = [Bucket(d["name"], (), tuple(d["paths"]), tuple(torch.Size(s) for s in d["shapes"]), tuple(d["offsets"]),
                      d["numel"], d["padded"], dp) for d in layout["buckets"][f"tp{t}-pp{p}"]]
    flats = {b.name: torch.zeros(b.padded) for b in buckets}
    for d in range(dp):
        with SafetensorsReader(optimizer_file(ckpt, t, p, d)) as reader:  # the masters only, not the moments
            for b in buckets:
                lo = b.shard_range(d)[0]
                for i, (_, start, end) in enumerate(shard_pieces(b, d)):
                    flats[b.name][lo + start:lo + end] = reader.get(f"master.{b.name}_{i}")
    return {path: view for b in buckets for path, view in b.views(flats[b.name]).items()}


def shard_leaves(ckpt: str | Path, t: int, p: int) -> dict[str, torch.Tensor]:
    """Shard (t, p)'s leaves by path: the fp32 masters where ``Adam3D`` keeps them (so a bf16 run exports
    its masters, not its bf16 weights), else the weights."""
    ckpt = Path(ckpt)
    layout = saved_layout(ckpt)
    if layout["zero"]:
        return _zero_masters(ckpt, layout, t, p)
    sd = load_file(shard_file(ckpt, t, p))
    masters = {k.removeprefix("master."): v for k, v in sd.items() if k.startswith("master.")}
    return masters or {k.removeprefix("param."): v for k, v in sd.items() if k.startswith("param.")}


def consolidate(ckpt: str | Path) -> tuple[Tree, Any]:
    """The whole model's parameters and its config from a checkpoint's shards, in one process (no group needed)."""
    ckpt = Path(ckpt)
    layout = saved_layout(ckpt)
    cfg = FAMILIES[layout["family"]].config(**layout["config"])
    spec = model_spec(cfg)
    shards: dict[str, list[torch.Tensor | None]] = {}
    for p in range(layout["pp"]):
        for t in range(layout["tp"]):
            for path, value in shard_leaves(ckpt, t, p).items():
                shards.setdefault(path, [None] * layout["tp"])[t] = value
    tree = empty_tree(spec)
    for leaf in spec.leaves:
        parts = shards.get(leaf.path)
        if parts is None or any(s is None for s in parts):
            raise CheckpointError(f"{ckpt} lacks shards of {leaf.path}: a shard file is missing or another model's")
        set_path(tree, leaf.path, unshard_leaf(leaf.path, parts, spec))
    return tree, cfg


def export_hf(ckpt: str | Path, out_dir: str | Path) -> Path:
    """One ``model.safetensors`` (and ``config.json``) in the Hugging Face layout."""
    tree, cfg = consolidate(ckpt)
    return save_hf(tree, cfg, out_dir)
