"""A Hugging Face checkpoint's tensor files: one ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor: shard file}}``), read and written tensor by tensor.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import torch

from weights.safetensors_io import CheckpointError, SafetensorsReader, nbytes, write_safetensors

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' default ``max_shard_size`` ("5GB")

Spec = tuple[str, tuple[int, ...], torch.dtype]  # a tensor's name, shape and dtype in the file


def tensor_files(path: str | Path) -> Path:
    """The file that lists a checkpoint's tensors: ``path`` itself (a ``.safetensors`` or an index), or the
    index or ``model.safetensors`` in the folder ``path``."""
    path = Path(path)
    if not path.is_dir():
        if not path.is_file():
            raise CheckpointError(f"checkpoint file not found: {path}")
        return path
    for name in (INDEX, SINGLE):
        if (path / name).is_file():
            return path / name
    raise CheckpointError(f"{path} holds neither {SINGLE} nor {INDEX}: not a Hugging Face checkpoint folder")


class CheckpointFiles:
    """Every tensor of a checkpoint by name, whichever file holds it; only headers are read until ``get``."""

    def __init__(self, path: str | Path):
        self.path = tensor_files(path)  # the file an error about the whole checkpoint names
        self._readers: dict[str, SafetensorsReader] = {}
        try:
            if self.path.name.endswith(".index.json"):
                weight_map = self._weight_map()
                self._where = {name: self._open(self.path.parent / shard) for name, shard in weight_map.items()}
            else:
                reader = self._open(self.path)
                self._where = {name: reader for name in reader.keys()}
        except BaseException:
            self.close()
            raise

    def _weight_map(self) -> dict[str, str]:
        try:
            weight_map = json.loads(self.path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{self.path} is not a safetensors index (JSON with a 'weight_map'): {e}") from e
        for name, shard in weight_map.items():
            if not (self.path.parent / shard).is_file():
                raise CheckpointError(f"{self.path} puts tensor {name!r} in shard {shard}, which is not in "
                                      f"{self.path.parent} (an incomplete download?)")
        return weight_map

    def _open(self, path: Path) -> SafetensorsReader:
        if path.name not in self._readers:
            self._readers[path.name] = SafetensorsReader(path)
        return self._readers[path.name]

    def keys(self) -> set[str]:
        return set(self._where)

    def file_of(self, name: str) -> Path:
        return self._where[name].path

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get(name)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()

    def __enter__(self) -> "CheckpointFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plan_shards(specs: list[Spec], max_shard_bytes: int | None) -> list[list[Spec]]:
    """Consecutive tensors grouped into shards of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        n = nbytes(*spec[1:])
        if max_shard_bytes is not None and shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards


def write_checkpoint(out_dir: str | Path, specs: Iterable[Spec], tensors: Iterator[torch.Tensor],
                     max_shard_bytes: int | None = DEFAULT_SHARD_BYTES) -> Path:
    """Write ``tensors`` (in ``specs`` order, produced one at a time) as ``model.safetensors``, or as
    ``model-0000k-of-0000n.safetensors`` shards and their index when they exceed ``max_shard_bytes``.

    Each file is written to a temporary name and renamed into place; the index comes last, and the files of
    the other layout (an earlier save's) are removed then, so a reader never sees a half-written set.
    Returns the file that lists the tensors.
    """
    out_dir = Path(out_dir)
    shards = plan_shards(list(specs), max_shard_bytes)
    names = [SINGLE] if len(shards) == 1 else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for k in range(len(shards))]
    for name, shard in zip(names, shards):
        path = write_safetensors(out_dir / name, shard, tensors)
    if len(shards) == 1:
        (out_dir / INDEX).unlink(missing_ok=True)
    else:
        index = {"metadata": {"total_size": sum(nbytes(*s[1:]) for shard in shards for s in shard)},
                 "weight_map": {spec[0]: name for name, shard in zip(names, shards) for spec in shard}}
        path = write_text(out_dir / INDEX, json.dumps(index, indent=2))
        (out_dir / SINGLE).unlink(missing_ok=True)
    for stale in out_dir.glob("model-*-of-*.safetensors"):
        if stale.name not in names:
            stale.unlink()
    return path


def write_text(path: Path, text: str) -> Path:
    """``path`` written whole or not at all: a temporary file renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
