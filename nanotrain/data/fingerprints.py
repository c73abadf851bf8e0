"""What a run trained on, small enough to store in a checkpoint, and what changed when it resumes.

The digest is over the token ids the batches are cut from (and, for instruction data, which of them
are trained), so it sees an edited file, another tokenizer, a changed chat template and a changed
``--data-dtype`` alike; the file's size and modification time say what kind of change it was.
BLAKE2b reads 0.4-1 GB/s: up to ``HASH_ALL_BYTES`` every byte is hashed; a larger corpus is hashed in
``SAMPLES`` spread slices (those the id check reads), and then a changed size or time counts too.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from pathlib import Path

import torch

HASH_ALL_BYTES = 1 << 28
SAMPLES, SAMPLE_BYTES = 64, 1 << 17


@dataclass(frozen=True)
class DataFingerprint:
    source: str            # as given (--data)
    size: int | None       # the file's bytes (None: not one file, e.g. stdlib)
    mtime_ns: int | None
    tokens: int
    digest: str
    sampled: bool = False  # the digest covers spread slices only

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "DataFingerprint":
        return cls(**{f.name: d.get(f.name) for f in fields(cls)})


def fingerprint(source: str, *arrays: torch.Tensor) -> DataFingerprint:
    """``source``'s identity and a digest of ``arrays`` (its tokens, and anything else the batches read)."""
    h = hashlib.blake2b(digest_size=16)
    sampled = sum(t.numel() * t.element_size() for t in arrays) > HASH_ALL_BYTES
    for t in arrays:
        h.update(f"{t.dtype}:{len(t)};".encode())
        flat = t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t.reshape(-1).to(torch.uint8)
        starts = torch.linspace(0, max(len(flat) - SAMPLE_BYTES, 0), SAMPLES).long().tolist() if sampled else [0]
        for i in starts:  # slices of a map: the corpus is never copied whole
            h.update(flat[i:i + SAMPLE_BYTES if sampled else len(flat)].numpy())
    path = Path(source)
    st = path.stat() if path.is_file() else None
    return DataFingerprint(source, st and st.st_size, st and st.st_mtime_ns, len(arrays[0]), h.hexdigest(), sampled)


def what_changed(saved: DataFingerprint, now: DataFingerprint) -> str | None:
    """One line saying how the data differs from what the checkpoint trained on; None when its tokens
    are the same (a file moved or touched is the same data, if every byte was hashed)."""
    if saved.digest == now.digest and (not now.sampled or (saved.size, saved.mtime_ns) == (now.size, now.mtime_ns)):
        return None
    changes = []
    if saved.source != now.source:
        changes.append(f"now {now.source}, was {saved.source}")
    if saved.size != now.size:
        changes.append(f"{now.size} bytes, was {saved.size}")
    if saved.mtime_ns != now.mtime_ns:
        changes.append(f"modified {_when(now.mtime_ns)}, was {_when(saved.mtime_ns)}")
    if saved.tokens != now.tokens:
        changes.append(f"{now.tokens} tokens, was {saved.tokens}")
    if not changes:
        changes.append("the same file and token count but other tokens (another tokenizer, chat template or dtype)")
    return f"the training data differs from the checkpoint's: {now.source}: {'; '.join(changes)}"


def _when(ns: int | None) -> str:
    return "unknown" if ns is None else datetime.fromtimestamp(ns / 1e9).isoformat(sep=" ", timespec="seconds")
