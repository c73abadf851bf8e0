"""Saved 3D state: one file per (tp, pp) shard, resumed at the same layout, consolidated to one HF file.

A checkpoint is a folder ``step-NNNNNN`` holding ``tp{t}-pp{p}.safetensors`` (that shard's
parameters and AdamW moments, as ``train.adapters.flat_state`` names them) and ``layout.json``.
Data-parallel replicas hold equal state, so only replica 0 writes. The folder is filled under a
temporary name and renamed into place by global rank 0 once every writer has finished, then
``latest`` names it: a crash leaves the previous checkpoint whole. Batches are a pure function of
the step, so the step is all a resumed run needs to draw what the uninterrupted one would have.

``consolidate`` needs no process group: it reads the shards of a checkpoint and puts every leaf
back together (``tensor_parallel.shard.unshard_leaf``), for ``weights.save_gpt2`` to write the
single ``model.safetensors`` that ``transformers`` loads.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from nanotrain.config import GPT2Config
from nanotrain.model import empty_tree, param_spec
from nanotrain.parallel3d.optimizer import Adam3D
from nanotrain.parallel3d.trainer import Parallel3DTrainer
from nanotrain.tensor_parallel.shard import unshard_leaf
from nanotrain.tree import Tree, set_path
from weights import save_gpt2
from weights.safetensors_io import CheckpointError, write_safetensors


def optimizer_of(trainer: Parallel3DTrainer) -> str:
    """Which optimizer's state the shards hold (checkpoints from before ``Adam3D`` hold torch's)."""
    opt = trainer.opt
    if isinstance(opt, Adam3D):
        return f"Adam3D, {opt.inner.cfg.state_bits}-bit moments, {str(opt.inner.cfg.dtype).removeprefix('torch.')}"
    return type(opt).__name__


def layout_of(trainer: Parallel3DTrainer) -> dict:
    """What a resumed run must share with the saved one: the model, how it is cut, the optimizer."""
    p3d = trainer.p3d
    return {"config": vars(p3d.plan.cfg), "tp": p3d.grid.tp, "pp": p3d.grid.pp, "dp": p3d.grid.dp,
            "stages": [[layer.name for layer in spec.layers] for spec in p3d.pipe.specs],
            "sequence_parallel": p3d.plan.sequence_parallel, "seq_len": p3d.seq_len,
            "optimizer": optimizer_of(trainer)}


def shard_file(folder: Path, tp_rank: int, pp_rank: int) -> Path:
    return folder / f"tp{tp_rank}-pp{pp_rank}.safetensors"


def save_3d(run_dir: str | Path, trainer: Parallel3DTrainer) -> Path:
    """Every rank calls this at the same step; returns the checkpoint folder."""
    run_dir, grid = Path(run_dir), trainer.p3d.grid
    final = run_dir / f"step-{trainer.step_count:06d}"
    tmp = run_dir / f".{final.name}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    if grid.dp_rank == 0:
        sd = trainer.state_dict()
        write_safetensors(shard_file(tmp, grid.tp_rank, grid.pp_rank),
                          [(k, tuple(t.shape), t.dtype) for k, t in sd.items()], (t for t in sd.values()))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / "layout.json").write_text(json.dumps({"step": trainer.step_count, **layout_of(trainer)}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = run_dir / ".latest.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, run_dir / "latest")
    dist.barrier()  # nobody reads ``latest`` before it exists
    return final


def latest_3d(run_dir: str | Path) -> Path:
    pointer = Path(run_dir) / "latest"
    if not pointer.is_file():
        raise CheckpointError(f"nothing to resume in {run_dir}: no 'latest' file; pass the run's --out folder")
    return Path(run_dir) / pointer.read_text().strip()


def restore_3d(trainer: Parallel3DTrainer, ckpt: str | Path) -> None:
    """Load this rank's shard and its moments, and the step, into a trainer of the same layout."""
    ckpt, grid = Path(ckpt), trainer.p3d.grid
    saved = json.loads((ckpt / "layout.json").read_text())
    saved.setdefault("optimizer", "AdamW")
    mine = layout_of(trainer)
    wrong = [k for k in mine if k != "dp" and saved.get(k) != mine[k]]
    if wrong:
        raise CheckpointError(f"{ckpt} was saved with another {wrong[0]} ({saved.get(wrong[0])} vs this run's "
                              f"{mine[wrong[0]]}); resume with the saved layout (tp {saved['tp']}, pp {saved['pp']}) "
                              f"and optimizer ({saved['optimizer']})")
    device = str(trainer.p3d.pipe.ctx.device)
    trainer.load_state_dict(load_file(shard_file(ckpt, grid.tp_rank, grid.pp_rank), device=device))
    trainer.step_count = int(saved["step"])


def consolidate(ckpt: str | Path) -> tuple[Tree, GPT2Config]:
    """The whole model's parameters from a checkpoint's shards, in one process (no group needed)."""
    ckpt = Path(ckpt)
    layout = json.loads((ckpt / "layout.json").read_text())
    cfg = GPT2Config(**layout["config"])
    shards: dict[str, list[torch.Tensor | None]] = {}
    for p in range(layout["pp"]):
        for t in range(layout["tp"]):
            for key, value in load_file(shard_file(ckpt, t, p)).items():
                if key.startswith("param."):
                    shards.setdefault(key.removeprefix("param."), [None] * layout["tp"])[t] = value
    tree = empty_tree(cfg)
    for path, _, _ in param_spec(cfg):
        parts = shards.get(path)
        if parts is None or any(s is None for s in parts):
            raise CheckpointError(f"{ckpt} lacks shards of {path}: a shard file is missing or another model's")
        set_path(tree, path, unshard_leaf(path, parts, cfg))
    return tree, cfg


def export_hf(ckpt: str | Path, out_dir: str | Path) -> Path:
    """One ``model.safetensors`` (and ``config.json``) in the Hugging Face GPT-2 layout."""
    tree, cfg = consolidate(ckpt)
    return save_gpt2(tree, cfg, out_dir)
