"""The one writer: every trainer's shard of its state (``core.train.shard``) in the one format (``slices.py``),
published whole or not at all (``run_dir``), checksummed (``checksums``), within the free space (``disk``).

A save has two halves. ``snapshot``, at the step boundary on every rank of the trainer's group: the temporary
folder is named (the first rank's), the free space checked, the manifest's lines gathered (each rank's pieces
are known before a byte is written), and, for a save written while training goes on, the shard copied to host
memory (the next update mutates the optimizer's buffers, on the host too). ``Snapshot.write``: every rank writes
its file, then (a barrier) the first writes ``manifest.json``, ``config.json`` and ``trainer.json`` and
publishes; a rank whose write failed makes every rank raise ``SaveFailed``, nothing published. ``save_checkpoint``
runs both at once; ``background.Saver`` runs the write on a thread.

Dropout masks are a function of the step, so no RNG state needs saving for the resumed run to repeat the
uninterrupted one exactly; the learning-rate schedule is saved with the step, so a resumed run follows the same
curve.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from nanotrain.checkpoint.disk import SaveFailed, check_space, cleaned_up, write_tensors
from nanotrain.checkpoint.run_dir import fsync_path, prune, publish, remove_stale, write_durably
from nanotrain.checkpoint.slices import FORMAT, MANIFEST, SCALARS
from nanotrain.core.train.schedule import LRSchedule
from nanotrain.core.train.step import Trainer
from nanotrain.data import DataPosition
from nanotrain.distributed import Group
from weights import hf_config
from weights.peft import CONFIG as ADAPTER_CONFIG, adapter_config


@dataclass
class Snapshot:
    """One rank's half of a save, taken at a step boundary: what it writes, and (the first rank) what it publishes."""
    run_dir: Path
    final: Path
    tmp: Path
    file: str | None                        # this rank's shard file (None: an equal copy elsewhere writes it all)
    tensors: dict[str, torch.Tensor]        # its entries, on the host: copies, or the optimizer's own buffers
    live: set[str]                          # those of ``tensors`` that are the optimizer's own (host) buffers
    small: dict[str, str] | None            # the first rank's JSON files by name; None on the others
    keep_last: int
    group: Group | None                     # over which the ranks wait for each other (None: one process)

    @property
    def live_bytes(self) -> int:
        """What ``own`` copies: the bytes of the optimizer's own buffers this rank writes."""
        return sum(self.tensors[k].numel() * self.tensors[k].element_size() for k in self.live)

    def own(self) -> None:
        """Copy what is still the optimizer's own buffers, so the next update may run while this is written."""
        self.tensors = {k: t.clone() if k in self.live else t for k, t in self.tensors.items()}
        self.live = set()

    def write(self) -> Path:
        """Write this rank's file; once every rank has, the first publishes. Every rank of ``group`` calls it
        (on whichever thread: ``group`` is used by this writer alone). Raises ``SaveFailed`` on every rank
        when any rank's write or the publish fails, what was written removed; ``latest`` stays on the checkpoint
        before."""
        try:
            _all_or_none(self.group, self._write_file)
        except SaveFailed:
            if self.small is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        _all_or_none(self.group, self._publish)  # nobody goes on (or exits) before the checkpoint is complete
        return self.final

    def _write_file(self) -> None:
        if self.file is not None:
            write_tensors(self.tmp / self.file, [(k, tuple(t.shape), t.dtype) for k, t in self.tensors.items()],
                          iter(self.tensors.values()))  # hashed as written (``checksums``)
            fsync_path(self.tmp / self.file)

    def _publish(self) -> None:
        if self.small is None:
            return
        with cleaned_up(self.run_dir, self.final):
            for name, text in self.small.items():
                write_durably(self.tmp / name, text)
            publish(self.run_dir, self.tmp, self.final)
        prune(self.run_dir, self.keep_last)
        remove_stale(self.run_dir)  # a killed re-save's folder that `latest` named until now


def snapshot(run_dir: str | Path, trainer: Trainer, position: DataPosition | None = None, meta: dict | None = None,
             schedule: LRSchedule | None = None, keep_last: int = 0) -> Snapshot:
    """This rank's half of a save of ``trainer``'s state as ``run_dir/step-N`` (collective over its group). Its
    device tensors are copied to the host; its host tensors are the optimizer's own until ``Snapshot.own``, so
    without that the write must finish before the next update."""
    run_dir, step, state = Path(run_dir), trainer.step_count, trainer.shard_state()  # waits for the updates
    group = state.group
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    final = run_dir / f"step-{step:06d}"
    name = [f".{final.name}.tmp-{os.getpid()}"]  # the first rank's process owns the temporary folder
    if group is not None:
        dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
    pieces = state.written()
    names = {p.name for p in pieces}
    keys = [k for k in state.entries if pieces and (k in SCALARS or k.partition(".")[2] in names)]
    file = f"shard-{rank:05d}-of-{world:05d}.safetensors" if pieces else None
    tensors = {k: state.entries[k].detach().cpu() for k in keys}
    live = {k for k in keys if state.entries[k].device.type == "cpu"}
    check_space(run_dir, final.name, sum(t.numel() * t.element_size() for t in tensors.values()), group)
    tmp = run_dir / name[0]
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    held = {"file": file, "tp": state.tp, "pieces": [[p.name, p.path, p.start, p.stop] for p in pieces]}
    shards = [held]
    if group is not None:
        shards = [None] * world
        dist.all_gather_object(shards, held, group=group)  # also: the folder exists before any rank writes in it
    small = None
    if rank == 0:
        shards = [s for s in shards if s["file"] is not None]
        manifest = {"format": FORMAT, "step": step, "layout": state.layout, "block": state.block,
                    "scalars": [k for k in SCALARS if k in state.entries], "files": [s["file"] for s in shards],
                    "shards": shards}
        info = {"step": step, "data_position": position and asdict(position), "meta": meta or {}}
        if schedule is not None:
            info["lr_schedule"] = schedule.to_dict()
        small = {"config.json": json.dumps(hf_config(trainer.cfg), indent=2),
                 "trainer.json": json.dumps(info, indent=2), MANIFEST: json.dumps(manifest, indent=1)}
        if trainer.spec is not None and trainer.spec.adapters:  # LoRA: its pairs' settings, whence a reader's spec
            small[ADAPTER_CONFIG] = json.dumps(adapter_config(trainer.spec), indent=2)
    return Snapshot(run_dir, final, tmp, file, tensors, live, small, keep_last, group)


def save_checkpoint(run_dir: str | Path, trainer: Trainer, position: DataPosition | None = None,
                    meta: dict | None = None, schedule: LRSchedule | None = None, keep_last: int = 0) -> Path:
    """Save the trainer's state as ``run_dir/step-N`` and point ``latest`` at it, before returning (every rank
    of its group calls it); then keep only the ``keep_last`` newest checkpoints (0: all) and remove what killed
    saves left. Raises ``disk.SaveFailed`` (nothing written, or what was written removed) when the disk has no
    room or a write fails."""
    return snapshot(run_dir, trainer, position, meta, schedule, keep_last).write()


def _all_or_none(group: Group | None, work: Callable[[], None]) -> None:
    """Run ``work`` on every rank; if it failed on any, raise ``SaveFailed`` (the first's words) on every one. Any
    failure: a rank that left here unsaid would leave the others waiting for it in the gather below."""
    try:
        work()
        why = None
    except SaveFailed as e:
        why = str(e)
    except OSError as e:
        why = f"could not save: {e.strerror or e} ({e.filename})"
    except Exception as e:  # e.g. a tensor safetensors cannot write
        why = f"could not save: {type(e).__name__}: {e}"
    if group is not None:
        whys = [None] * dist.get_world_size(group)
        dist.all_gather_object(whys, why, group=group)
        why = next((w for w in whys if w is not None), None)
    if why is not None:
        raise SaveFailed(why)
