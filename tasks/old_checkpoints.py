"""Checkpoints saved before nanotrain's one sharded format (``nanotrain.checkpoint.slices``) no longer resume;
``tasks.export`` (``tasks.consolidate``) reads their masters here, so that a run starts again from the exported
folder with ``--weights``: a data-parallel ``manifest.json`` of flat bucket shards, or a 3D ``layout.json`` of
per-(tp, pp) files.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from nanotrain.data_parallel.buckets import Bucket, rank_pieces
from nanotrain.checkpoint.slices import FORMAT, MANIFEST
from nanotrain.core.models import FAMILIES, model_spec
from nanotrain.tensor_parallel.shard import unshard_leaf
from weights import CheckpointError
from weights.safetensors_io import SafetensorsReader


def _buckets(layout: list[dict], world: int) -> list[Bucket]:
    return [Bucket(d["name"], (), tuple(d["paths"]), tuple(torch.Size(s) for s in d["shapes"]), tuple(d["offsets"]),
                   d["numel"], d["padded"], world) for d in layout]


def old_data_parallel_masters(ckpt: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """Format ``nanotrain-sharded-1``: each rank's file held one flat shard of masters per bucket."""
    files = [ckpt / f for f in manifest["files"]]
    out = {}
    for b in _buckets(manifest["layout"], manifest["world"]):
        parts = []
        for f in files:
            with SafetensorsReader(f) as reader:
                parts.append(reader.get(f"master.{b.name}"))
        out.update(b.views(torch.cat(parts)))
    return out


def old_3d_masters(ckpt: Path, layout: dict) -> tuple[dict[str, torch.Tensor], Any]:
    """``layout.json``: a file per (tp, pp) shard, with masters (``Adam3D``) or weights (torch's AdamW), or
    under ZeRO-1 a file per dp rank of masters by piece of the manifest's buckets; the leaves unsharded over tp."""
    cfg = FAMILIES[layout.get("family", "gpt2")].config(**layout["config"])
    shards: dict[str, list[torch.Tensor]] = {}
    for p in range(layout["pp"]):
        for t in range(layout["tp"]):
            if layout.get("zero"):
                buckets = _buckets(layout["buckets"][f"tp{t}-pp{p}"], layout["dp"])
                flats = {b.name: torch.zeros(b.padded) for b in buckets}
                for d in range(layout["dp"]):
                    with SafetensorsReader(ckpt / f"tp{t}-pp{p}-dp{d}.safetensors") as reader:
                        for b in buckets:
                            lo = b.shard_range(d)[0]
                            for piece in rank_pieces(b, d):
                                flats[b.name][lo + piece.lo:lo + piece.hi] = reader.get(f"master.{piece.name}")
                leaves = {path: v for b in buckets for path, v in b.views(flats[b.name]).items()}
            else:
                sd = load_file(ckpt / f"tp{t}-pp{p}.safetensors")
                kind = "master." if any(k.startswith("master.") for k in sd) else "param."
                leaves = {k.removeprefix(kind): v for k, v in sd.items() if k.startswith(kind)}
            for path, v in leaves.items():
                shards.setdefault(path, [None] * layout["tp"])[t] = v
    spec = model_spec(cfg)
    return {path: unshard_leaf(path, parts, spec) for path, parts in shards.items()}, cfg


def is_old(ckpt: Path) -> bool:
    """Saved in a format before the one sharded format (``layout.json``, or a manifest of another format)."""
    manifest = ckpt / MANIFEST
    return (ckpt / "layout.json").is_file() or manifest.is_file() and json.loads(manifest.read_text()).get(
        "format") != FORMAT


def old_masters(ckpt: Path, cfg: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """An old-format checkpoint's fp32 masters by tree path, and its model (``cfg``, or the one a 3D layout
    names)."""
    if (ckpt / "layout.json").is_file():
        masters, saved = old_3d_masters(ckpt, json.loads((ckpt / "layout.json").read_text()))
        return masters, cfg or saved
    if cfg is None:
        raise CheckpointError(f"{ckpt} does not say which model it holds; pass --model")
    return old_data_parallel_masters(ckpt, json.loads((ckpt / MANIFEST).read_text())), cfg
