"""What a save needs from the file system: a folder it can write, room, and a clean failure.

A run's ``--out`` that is a file or cannot be written is refused in one line before anything
starts (``check_writable``). A save that needs more bytes than the file system has free is refused
before a byte is written (``check_space``). A save that fails all the same (the disk fills up
meanwhile, an I/O error) removes what it wrote at once, so a full disk is not kept full by a
half-written checkpoint until the next start, and raises ``SaveFailed``: one line, ``latest`` still
on the checkpoint before. The task stops the run there (the next save would most likely fail too,
and every step trained meanwhile would be lost with the process).
"""
from __future__ import annotations

import errno
import hashlib
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from nanotrain.checkpoint.checksums import sidecar
from nanotrain.checkpoint.run_dir import named_by_latest, remove_stale
from weights.safetensors_io import CheckpointError, write_safetensors


class SaveFailed(RuntimeError):
    """A checkpoint could not be written: nothing of it is left, and ``latest`` names the one before."""


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check_space(run_dir: Path, name: str, nbytes: int, group: dist.ProcessGroup | None = None) -> None:
    """Refuse (``SaveFailed``) to save ``name``, ``nbytes`` of tensors (summed over ``group``: every rank
    writes its part to the same file system), where the file system has not that much free."""
    if group is not None:  # an object collective: the same on gloo and NCCL
        parts = [0] * dist.get_world_size(group)
        dist.all_gather_object(parts, nbytes, group=group)
        nbytes = sum(parts)
    there = next(p for p in (run_dir, *run_dir.absolute().parents) if p.exists())  # the folder may not exist yet
    need, free = nbytes + (1 << 20), shutil.disk_usage(there).free  # the JSON and headers: well under 1 MiB
    if need > free:
        raise SaveFailed(f"not enough disk space to save {name}: it needs {_gb(need)} and {run_dir} has "
                         f"{_gb(free)} free; nothing was written")


@contextmanager
def cleaned_up(run_dir: Path, final: Path) -> Iterator[None]:
    """A save of ``final`` that fails with an ``OSError`` (a full disk, an I/O error) removes what it wrote at
    once, then raises ``SaveFailed`` in one line; ``latest`` stays on the checkpoint before."""
    existed = final.exists()
    try:
        yield
    except (OSError, SaveFailed) as e:  # SaveFailed: a tensor file's writer failed (its helper threads are done)
        if not existed and final.exists() and named_by_latest(run_dir) != final:
            shutil.rmtree(final, ignore_errors=True)  # renamed into place, but `latest` never named it
        remove_stale(run_dir)  # this process's temporaries; never what `latest` names, nor another live save's
        if isinstance(e, SaveFailed):
            raise
        where = f" ({e.filename})" if e.filename else ""
        raise SaveFailed(f"could not save {final.name}: {e.strerror or e}{where}; the partial checkpoint was "
                         f"removed") from e


def write_tensors(path: Path, specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                  tensors: Iterator[torch.Tensor]) -> Path:
    """Write a tensor file into a save's temporary folder, hashed as it is written, the digest left beside it
    (``checksums``); if it cannot be written, the folder goes at once (the save has failed) and ``SaveFailed``
    says why."""
    digest = hashlib.sha256()
    try:
        write_safetensors(path, specs, tensors, digest=digest)
        sidecar(path).write_text(digest.hexdigest())
        return path
    except OSError as e:
        shutil.rmtree(path.parent, ignore_errors=True)
        raise SaveFailed(f"could not write {path.name}: {e.strerror or e}; the partial checkpoint "
                         f"{path.parent.name} was removed") from e


def check_writable(run_dir: Path) -> None:
    """Refuse (``CheckpointError``, one line) a run folder that is a file, or where nothing can be written;
    creates nothing (the folder, when missing, is checked where it would be created)."""
    there = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not there.is_dir():
        raise CheckpointError(f"--out {run_dir}: {there} is a file, not a folder; pass a folder (it is created if "
                              f"missing)")
    try:
        tempfile.TemporaryFile(dir=there).close()  # nameless where the system allows: nothing left behind
    except OSError as e:
        why = "a read-only file system" if e.errno == errno.EROFS else (e.strerror or str(e))
        raise CheckpointError(f"cannot write in --out {run_dir}: {why}; pass a folder you can write to") from None
