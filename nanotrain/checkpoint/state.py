"""Save and resume a fine-tuning run: weights (HF layout), optimizer state, step and data position, published
whole or not at all (``checkpoint.run_dir``), checksummed (``checkpoint.checksums``), within the free space (``checkpoint.disk``).

Dropout masks are a function of the step, so no RNG state needs saving for the resumed run to repeat the
uninterrupted one exactly; the learning-rate schedule is saved with the step, so a resumed run follows the same
curve.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file

from nanotrain.data import DataPosition
from nanotrain.checkpoint.checksums import digested_meanwhile
from nanotrain.checkpoint.disk import check_space, cleaned_up, write_tensors
from nanotrain.checkpoint.run_dir import prune, publish, remove_stale, write_durably
from nanotrain.core.train.schedule import LRSchedule
from nanotrain.core.train.step import Trainer
from nanotrain.core.tree import named_leaves
from weights import hf_config, save_hf
from weights.files import write_text
from weights.peft import save_adapter
from weights.safetensors_io import SafetensorsReader


def save_checkpoint(run_dir: str | Path, trainer: Trainer, position: DataPosition, meta: dict | None = None,
                    schedule: LRSchedule | None = None, keep_last: int = 0) -> Path:
    """Save the trainer's state as ``run_dir/step-N`` and point ``latest`` at it; then keep only the
    ``keep_last`` newest checkpoints (0: all) and remove what killed saves left. Raises ``disk.SaveFailed``
    (nothing written, or what was written removed) when the disk has no room or a write fails."""
    run_dir = Path(run_dir)
    step = trainer.step_count
    final = run_dir / f"step-{step:06d}"
    tmp = run_dir / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    sd = trainer.state_dict()  # waits for the pending updates
    masters = trainer.master_params()
    check_space(run_dir, final.name, sum(t.numel() * t.element_size() for t in sd.values())
                + sum(t.numel() * 4 for _, t in named_leaves(masters) if t is not None))  # fp32 (LoRA: the pairs)
    with cleaned_up(run_dir, final):
        if trainer.spec is not None and trainer.spec.adapters:  # LoRA: the pairs as a PEFT folder, the base's config
            save_adapter(tmp, trainer.spec, masters)
            write_text(tmp / "config.json", json.dumps(hf_config(trainer.cfg), indent=2))
        else:
            save_hf(masters, trainer.cfg, tmp, max_shard_bytes=None)
        with digested_meanwhile(tmp):  # the weights' file, read back while the optimizer's is written and hashed
            write_tensors(tmp / "optimizer.safetensors", [(k, tuple(t.shape), t.dtype) for k, t in sd.items()],
                          iter(sd.values()))
        state = {"step": step, "data_position": asdict(position), "meta": meta or {}}
        if schedule is not None:
            state["lr_schedule"] = schedule.to_dict()
        write_durably(tmp / "trainer.json", json.dumps(state, indent=2))
        publish(run_dir, tmp, final)
    prune(run_dir, keep_last)
    remove_stale(run_dir)  # a killed re-save's folder that `latest` named until now
    return final


def restore(trainer: Trainer, ckpt: str | Path) -> DataPosition:
    """Load optimizer state (and with it the weights) and step into a trainer built with the same settings."""
    ckpt = Path(ckpt)
    state = json.loads((ckpt / "trainer.json").read_text())
    trainer.load_state_dict(load_file(ckpt / "optimizer.safetensors"))
    trainer.step_count = int(state["step"])
    return DataPosition(**state["data_position"])


def saved_schedule(ckpt: str | Path) -> LRSchedule | None:
    """The learning-rate schedule a checkpoint's run followed (None for checkpoints saved without one)."""
    saved = json.loads((Path(ckpt) / "trainer.json").read_text()).get("lr_schedule")
    return None if saved is None else LRSchedule.from_dict(saved)


def load_masters(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a checkpoint by tree path (what the trainer is rebuilt from).

    Reads only those tensors: ``restore`` reads the moments once the trainer exists.
    """
    with SafetensorsReader(Path(ckpt) / "optimizer.safetensors") as f:
        return {k.removeprefix("master."): f.get(k) for k in f.keys() if k.startswith("master.")}
