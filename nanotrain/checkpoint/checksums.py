"""Each checkpoint file's SHA-256, written when the checkpoint is published and checked before it is used.

``SHA256SUMS`` in a checkpoint folder lists every file of it with its SHA-256, in the format of
``sha256sum`` (so ``cd OUT/step-N && sha256sum -c SHA256SUMS`` checks it without nanotrain).
``run_dir.publish`` writes it for every checkpoint. Tensor files written with ``disk.write_tensors`` are
hashed while they are written, and the digest waits beside the file as ``.NAME.sha256`` until ``publish``
collects it, so no rank reads another's shard back; any other file (the JSON) is read back once. ``verify`` reads every listed file and names the first that is missing or
differs: resuming (``run_dir.find_checkpoint``) then takes the newest checkpoint that passes, and
exporting (``tasks.consolidate``) refuses.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from weights.safetensors_io import CheckpointError

SUMS = "SHA256SUMS"
_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")


def sidecar(path: Path) -> Path:
    """Where the digest of ``path`` waits until ``write_sums`` collects it."""
    return path.with_name(f".{path.name}.sha256")


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_sums(folder: Path) -> None:
    """Write ``folder/SHA256SUMS`` over the files in ``folder`` (the digests their writers left, else read
    back), then remove those digests. The caller flushes the folder to disk."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".") and p.name != SUMS)
    lines = []
    for f in files:
        side = sidecar(f)
        lines.append(f"{side.read_text().strip() if side.is_file() else file_sha256(f)}  {f.name}\n")
    (folder / SUMS).write_text("".join(lines))
    for side in folder.glob(".*.sha256"):
        side.unlink()


def read_sums(folder: Path) -> dict[str, str] | None:
    """``file name -> SHA-256`` from ``folder/SHA256SUMS``; None for a checkpoint saved before checksums."""
    path = folder / SUMS
    if not path.is_file():
        return None
    sums = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = _LINE.fullmatch(line)
        if m is None:
            raise CheckpointError(f"{path} line {n} is not '<sha256>  <file>': the list itself is damaged")
        sums[m.group(2)] = m.group(1)
    return sums


def verify(ckpt: str | Path) -> bool:
    """Check every file ``ckpt/SHA256SUMS`` lists; raise ``CheckpointError`` naming the first one missing or
    changed. False (nothing checked) for a checkpoint saved before checksums."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt} is not a checkpoint folder")
    sums = read_sums(ckpt)
    if sums is None:
        return False
    for name, expected in sums.items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (it is listed in {SUMS})")
        if file_sha256(path) != expected:
            raise CheckpointError(f"{path} does not match its SHA-256 in {SUMS}: it changed after it was saved "
                                  f"(disk, copy or edit)")
    return True
