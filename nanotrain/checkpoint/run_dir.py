"""A run folder's checkpoints on disk: publish one durably, find the one to resume, clean up, prune.

A checkpoint is a folder ``step-NNNNNN`` written in full under ``.step-NNNNNN.tmp-PID``, flushed
to disk (files, then folder) and renamed into place; ``latest``, a one-line file replaced the same
way, names the newest. At every instant ``latest`` resolves to a complete checkpoint, a re-save of
an existing step included:

1. the new copy is complete in ``.step-N.tmp-PID``;
2. ``latest`` names that temporary folder;
3. the old ``step-N`` is renamed to ``.step-N.old-PID`` (then removed, at the end);
4. the temporary folder is renamed to ``step-N``: ``latest`` names a folder that has just been
   renamed, and ``find_checkpoint`` reads a temporary name it cannot find as its final name;
5. ``latest`` names ``step-N``.

A kill (or power loss) at any point leaves ``latest`` on a complete checkpoint, and the temporary
and old folders of killed saves are removed at the next start (``remove_stale``). Every published
folder holds ``SHA256SUMS`` (``checkpoint.checksums``): a resume takes the newest checkpoint whose files
are all there and unchanged. A save that fails, or cannot fit the free space, leaves ``latest`` where it
was (``checkpoint.disk``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import NamedTuple

from nanotrain.checkpoint.checksums import SUMS, read_sums, verify, write_sums
from weights.safetensors_io import CheckpointError

FILES = ("model.safetensors", "config.json", "optimizer.safetensors", "trainer.json")  # the old one-process layout's
_STEP = re.compile(r"step-(\d+)")
_TEMP = re.compile(r"\.(step-\d+)\.(tmp|old)-(\d+)|\.latest\.tmp-(\d+)")


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries (the names created or renamed in it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def point_latest(run_dir: Path, name: str) -> None:
    tmp = run_dir / f".latest.tmp-{os.getpid()}"
    write_durably(tmp, name + "\n")
    os.replace(tmp, run_dir / "latest")
    fsync_path(run_dir)


def publish(run_dir: Path, tmp: Path, final: Path) -> None:
    """Make the complete folder ``tmp`` the checkpoint ``final`` and ``latest`` (steps in the module doc)."""
    write_sums(tmp)
    for f in tmp.iterdir():
        fsync_path(f)
    fsync_path(tmp)
    old = None
    if final.exists():  # a re-save: steps 2 and 3
        point_latest(run_dir, tmp.name)
        old = run_dir / f".{final.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(run_dir)
    point_latest(run_dir, final.name)
    if old is not None:
        shutil.rmtree(old)


def _needed(folder: Path) -> tuple[str, ...]:
    """The files a complete checkpoint holds: those its SHA256SUMS lists, else (saved before checksums) its
    manifest's (``manifest.json``: data-parallel shards; ``layout.json``: 3D), else one process's."""
    sums = read_sums(folder)
    if sums is not None:
        return (SUMS, *sums)
    for manifest, extra in (("manifest.json", ("config.json", "trainer.json")), ("layout.json", ())):
        if (folder / manifest).is_file():
            try:
                return (manifest, *extra, *json.loads((folder / manifest).read_text())["files"])
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{folder.name}/{manifest} is unreadable ({e})") from None
    return FILES


def incomplete(folder: Path) -> str | None:
    """Why ``folder`` is not a checkpoint that can be resumed (a file missing), or None if it is one."""
    if not folder.is_dir():
        return f"{folder.name} does not exist"
    try:
        needed = _needed(folder)
    except CheckpointError as e:
        return str(e)
    missing = [f for f in needed if not (folder / f).is_file()]
    if missing:
        return f"{folder.name} is incomplete (no {', '.join(missing)})"
    if "trainer.json" in needed and SUMS not in needed:  # with checksums, ``verify`` finds a damaged one
        try:
            json.loads((folder / "trainer.json").read_text())["step"]
        except (ValueError, KeyError) as e:
            return f"{folder.name}/trainer.json is unreadable ({e})"
    return None


def step_folders(run_dir: Path) -> list[Path]:
    """The ``step-N`` folders of a run, newest (highest step) first."""
    found = [p for p in run_dir.iterdir() if p.is_dir() and _STEP.fullmatch(p.name)] if run_dir.is_dir() else []
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def named_by_latest(run_dir: Path) -> Path | None:
    """The folder ``latest`` names, a temporary name of step 4 read as its final one; None without ``latest``."""
    pointer = run_dir / "latest"
    if not pointer.is_file():
        return None
    path = run_dir / pointer.read_text().strip()
    m = _TEMP.fullmatch(path.name)
    if not path.exists() and m and m.group(1):
        path = run_dir / m.group(1)
    return path


class Found(NamedTuple):
    path: Path                 # the checkpoint to resume
    note: str | None           # one line: why it is not the newest, or that it was saved without checksums
    corrupt: tuple[Path, ...]  # newer checkpoints skipped because a file differs from its checksum


def find_checkpoint(run_dir: str | Path) -> Found:
    """The checkpoint to resume: what ``latest`` names if it is complete and its files match their
    checksums, else the newest ``step-N`` folder that is (the note says why it fell back)."""
    run_dir = Path(run_dir)
    named = named_by_latest(run_dir)
    others = [p for p in step_folders(run_dir) if named is None or p.name != named.name]
    whys = ["no 'latest' file"] if named is None else []
    corrupt = []
    for ckpt in ([named] if named is not None else []) + others:
        why = incomplete(ckpt)
        if why is None:
            try:
                checked = verify(ckpt)
            except CheckpointError as e:
                why = str(e)
                corrupt.append(ckpt)
        if why is not None:
            whys.append(why)
            continue
        unchecked = None if checked else f"{ckpt.name} has no {SUMS} (saved before checksums): its files are not " \
                                         f"verified"
        note = f"{whys[0]}; resuming from {ckpt.name}, the newest intact checkpoint" if whys else None
        return Found(ckpt, "; ".join(n for n in (note, unchecked) if n) or None, tuple(corrupt))
    raise CheckpointError(f"nothing to resume in {run_dir}: {'; '.join(whys)}, and no intact step-N folder (was a "
                          f"checkpoint ever saved there? pass the run's --out folder)")


def set_aside(corrupt: tuple[Path, ...]) -> list[Path]:
    """Rename checkpoints whose files do not match their checksums to ``step-N.corrupt``: out of the way of
    resumes and retention (which would count them among the newest), their intact files kept."""
    moved = []
    for ckpt in corrupt:
        target = ckpt.with_name(f"{ckpt.name}.corrupt")
        if ckpt.is_dir() and not target.exists():
            os.replace(ckpt, target)
            moved.append(target)
    return moved


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process is only starting: nothing of its own is being saved
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(run_dir: str | Path) -> list[str]:
    """Remove what killed saves left (temporary and old folders, ``latest`` temporaries) whose process
    is gone, never the folder ``latest`` names; returns the names removed."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    keep = (run_dir / "latest").read_text().strip() if (run_dir / "latest").is_file() else None
    removed = []
    for p in sorted(run_dir.iterdir()):
        m = _TEMP.fullmatch(p.name)
        if m is None or p.name == keep or _alive(int(m.group(3) or m.group(4))):
            continue
        shutil.rmtree(p) if p.is_dir() else p.unlink()
        removed.append(p.name)
    return removed


def prune(run_dir: str | Path, keep_last: int) -> list[str]:
    """Remove all but the ``keep_last`` newest complete checkpoints (0: keep all), never the one
    ``latest`` names; each goes by a rename first, so a kill never leaves a half-deleted ``step-N``."""
    run_dir = Path(run_dir)
    if keep_last < 1:
        return []
    named = named_by_latest(run_dir)
    complete = [p for p in step_folders(run_dir) if incomplete(p) is None]
    removed = []
    for p in complete[keep_last:]:
        if named is not None and p.name == named.name:
            continue
        trash = run_dir / f".{p.name}.old-{os.getpid()}"
        os.replace(p, trash)
        shutil.rmtree(trash)
        removed.append(p.name)
    return removed

