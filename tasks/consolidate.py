"""Export a checkpoint's model as a Hugging Face folder (config.json, safetensors shards and their
index, the model's tokenizer files) that ``tasks.generate --model OUT``, ``--weights OUT`` and ``transformers`` load.

    python -m tasks.consolidate runs/finetune/step-000030 --out runs/finetune/hf
    python -m tasks.consolidate runs/finetune/step-000030 --verify    # any checkpoint: its files vs SHA256SUMS

The model (a preset, a Hugging Face folder or a hub id) is read from the checkpoint (the run's own
arguments, or its config.json), or given with ``--model``. The weights are the run's fp32 masters. The
checkpoint's files are checked against their SHA-256 (``SHA256SUMS``) before anything is exported.

Checkpoints saved before nanotrain's one sharded format (``nanotrain.checkpoint.slices``) no longer
resume; this converts them too (a data-parallel ``manifest.json`` of flat bucket shards, or a 3D
``layout.json`` of per-(tp, pp) files), so that a run starts again from the folder with ``--weights``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from nanotrain.run.cli import fail, resolve
from nanotrain.data_parallel.buckets import Bucket, rank_pieces
from nanotrain.checkpoint.resume import consolidate
from nanotrain.checkpoint.slices import FORMAT, MANIFEST
from nanotrain.core.models import FAMILIES, model_spec
from nanotrain.core.models.run import tree_from
from nanotrain.tensor_parallel.shard import unshard_leaf
from nanotrain.checkpoint.checksums import SUMS, verify
from weights import CheckpointError, copy_tokenizer, save_hf
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


def convert_old(ckpt: Path, out: Path, cfg: Any) -> Path:
    """An old-format checkpoint's masters as a Hugging Face folder."""
    if (ckpt / "layout.json").is_file():
        masters, saved = old_3d_masters(ckpt, json.loads((ckpt / "layout.json").read_text()))
        cfg = cfg or saved
    else:
        masters = old_data_parallel_masters(ckpt, json.loads((ckpt / MANIFEST).read_text()))
    return save_hf(tree_from(model_spec(cfg), masters.items()), cfg, out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a step-N folder of a checkpoint")
    ap.add_argument("--out", type=Path, help="the Hugging Face folder to write")
    ap.add_argument("--model", default=None, help="the model (default: the one the run trained)")
    ap.add_argument("--verify", action="store_true",
                    help=f"only check the checkpoint's files (any format) against its {SUMS}; writes nothing")
    args = ap.parse_args(argv)
    ckpt = args.checkpoint
    # Checksums (nanotrain.checkpoint.checksums): nothing is exported from files that changed since the save.
    try:
        checked = verify(ckpt)
    except CheckpointError as e:
        fail(str(e))
    if args.verify:
        print(f"{ckpt}: every file matches its SHA-256 in {SUMS}" if checked else
              f"{ckpt} has no {SUMS} (saved before checksums): nothing to verify")
        return
    if args.out is None:
        ap.error("--out is required (or --verify)")
    trainer = ckpt / "trainer.json"
    name = args.model or (json.loads(trainer.read_text()).get("meta", {}).get("model") if trainer.is_file() else None)
    model = resolve(name) if name else None
    old = (ckpt / "layout.json").is_file() or (
        (ckpt / MANIFEST).is_file() and json.loads((ckpt / MANIFEST).read_text()).get("format") != FORMAT)
    if old and model is None and not (ckpt / "layout.json").is_file():
        fail(f"{ckpt} does not say which model it holds; pass --model")
    try:
        cfg = model and model.cfg
        path = convert_old(ckpt, args.out, cfg) if old else consolidate(ckpt, cfg, args.out)
    except (CheckpointError, ValueError) as e:
        fail(str(e))
    tokenizer = model and model.tokenizer_folder()
    copied = copy_tokenizer(tokenizer, args.out) if tokenizer is not None else []
    print(f"wrote {path}" + (f" and {', '.join(p.name for p in copied)}" if copied else ""))


if __name__ == "__main__":
    main()
