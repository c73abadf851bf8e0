"""The one reader: a checkpoint of any layout back into a trainer of any layout, its masters, its schedule.

Each rank reads, for each piece it now holds (``Trainer.shard_state``), the saved pieces it overlaps
(``slices.read_entries``): at the saved layout only its own file, at another what it needs, so a run saved at
3 ranks resumes at 2, as one process or as a 3D layout, and a one-process run under data or 3D parallelism
(8-bit moments only at their tensor-parallel cut: ``check_resumable``). A checkpoint of the old one-process
layout reads the same way (``legacy``); an old sharded layout is refused with the conversion command.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from nanotrain.checkpoint.slices import SliceReader, check, read_entries, read_manifest
from nanotrain.core.leaves import Leaves
from nanotrain.core.train.schedule import LRSchedule
from nanotrain.core.train.step import Trainer
from nanotrain.data import DataPosition
from weights.safetensors_io import CheckpointError


def check_resumable(ckpt: str | Path, tp: int | None = None, block: int | None = None) -> dict:
    """Refuse, before any rank starts, a checkpoint that cannot resume with whole leaves (``tp=None``) or
    ``tp`` tensor-parallel ranks: an old sharded layout (saying how to convert it), a missing file, 8-bit
    moments at another cut or ``block``. Returns the manifest."""
    manifest = read_manifest(ckpt)
    check(manifest, ckpt, tp, block)
    return manifest


def restore(trainer: Trainer, ckpt: str | Path) -> DataPosition | None:
    """Load this rank's pieces, from whichever saved pieces hold them, and the step (every rank of the trainer's
    group calls it); returns the data position (None for a run that draws its batches by step)."""
    state = trainer.shard_state()
    with SliceReader(ckpt) as reader:
        if reader.spec.shapes != trainer.spec.shapes:
            raise CheckpointError(f"{reader.ckpt} holds another model than this run's ({reader.cfg}); resume with "
                                  f"that model")
        trainer.load_shard_state(read_entries(state, reader))
    trainer.step_count = int(reader.manifest["step"])
    saved = json.loads((Path(ckpt) / "trainer.json").read_text())["data_position"]
    return saved and DataPosition(**saved)


def saved_schedule(ckpt: str | Path) -> LRSchedule | None:
    """The learning-rate schedule a checkpoint's run followed (None for checkpoints saved without one)."""
    saved = json.loads((Path(ckpt) / "trainer.json").read_text()).get("lr_schedule")
    return None if saved is None else LRSchedule.from_dict(saved)


@contextmanager
def saved_masters(ckpt: str | Path) -> Iterator[Leaves]:
    """Any checkpoint's fp32 masters (a LoRA run's: its pairs) by tree path (``core.leaves``), each leaf read when
    taken, its saved slices (ranks, tensor-parallel cuts) assembled for it alone: an export, or a streamed trainer,
    holds one leaf at a time, whatever the model."""
    with SliceReader(ckpt) as reader:
        yield Leaves({leaf.path: leaf.shape for leaf in reader.spec.leaves if leaf.trainable},
                     lambda path: reader.whole("master", path))


def load_masters(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """Any checkpoint's fp32 master weights, whole, by tree path: what a trainer is rebuilt from
    (``tree_from(spec, masters.items())`` makes the parameter tree). A LoRA run's: its pairs."""
    with saved_masters(ckpt) as masters:
        return {path: masters.read(path) for path in masters.shapes}
