"""Safetensors I/O one tensor at a time.

Writing streams each tensor to disk as it is produced (the header only needs shapes), so saving
or randomly initialising gpt2-xl never holds a second copy of the model. Every write goes to a
temporary file that is renamed into place, so a crash never leaves a half-written checkpoint.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
          torch.int32: "I32", torch.int16: "I16", torch.uint8: "U8", torch.int8: "I8", torch.float64: "F64",
          torch.bool: "BOOL"}


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, corrupt, or does not match the model."""


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes of a tensor of ``shape`` and ``dtype`` in the file."""
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy view of a contiguous CPU tensor's bytes; the caller keeps ``t`` alive."""
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def write_safetensors(path: str | Path, specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                      tensors: Iterator[torch.Tensor], digest: hashlib._Hash | None = None) -> Path:
    """Write tensors named and shaped by ``specs``, produced one by one, in their order, by ``tensors``.

    Each produced tensor is checked against its spec before a byte of it is written. ``digest``
    (a ``hashlib`` object) is fed every byte of the file as it is written (``Hashing``), so a
    checksum costs no second read of the file.
    """
    path = Path(path)
    specs = list(specs)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in specs:
        size = nbytes(shape, dtype)
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format asks the data to start 8-byte aligned
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as f, Hashing(digest) as hashing:
            for head in (struct.pack("<Q", len(blob)), blob):
                f.write(head)
                hashing.add(head, head)
            for name, shape, dtype in specs:
                t = next(tensors).detach().to(device="cpu", dtype=dtype).contiguous()
                if tuple(t.shape) != tuple(shape):
                    raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
                data = _raw_bytes(t)
                f.write(data)
                hashing.add(data, t)
                del t, data  # let go before the next is produced (``hashing`` keeps what it still reads)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


class Hashing:
    """Feeds ``digest`` (None: nothing) each buffer written, on a helper thread while the next one is
    produced and written: hashlib and file writes both release the GIL, so where the disk is the
    bottleneck the hash costs no time. One buffer is in flight at a time, in order."""

    def __init__(self, digest: hashlib._Hash | None):
        self.digest = digest
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sha256") if digest is not None else None
        self._pending: tuple[Future, object] | None = None  # the update under way, and what its bytes belong to

    def add(self, data: memoryview | bytes, owner: object) -> None:
        """Hash ``data``, which ``owner`` keeps valid, after the buffers added before it."""
        if self._pool is None:
            return
        self._wait()
        self._pending = (self._pool.submit(self.digest.update, data), owner)

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending[0].result()
            self._pending = None

    def __enter__(self) -> "Hashing":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._wait()
            self._pool.shutdown()


_DTYPES = {name: dtype for dtype, name in DTYPES.items()}


class SafetensorsReader:
    """``safe_open`` with errors that name the file: shapes first (no data read), then tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._entries: dict | None = None  # the header, read on the first get
        self._file = None
        self._data_start = 0
        if not self.path.is_file():
            raise CheckpointError(f"checkpoint file not found: {self.path}")
        try:
            self._f = safe_open(str(self.path), framework="pt", device="cpu")
            self._f.__enter__()
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{self.path} is not a readable safetensors file (corrupt or truncated?): {e}") from e

    def keys(self) -> list[str]:
        return list(self._f.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._f.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``, read with plain file reads.

        Not through ``safe_open``'s memory map: its pages count in this process's RSS until the file
        is closed, so loading GPT-2-XL that way peaks 6 GB higher, which a 16 GiB host budget
        (the streaming trainer's) cannot spare. The page cache that reads go through is not RSS.
        """
        entry = self._header().get(name)
        if entry is None or entry["dtype"] not in _DTYPES:
            return self._mapped(name)
        t = torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        if end - begin != t.numel() * t.element_size():
            raise CheckpointError(f"tensor {name!r} in {self.path} has {end - begin} bytes for shape "
                                  f"{entry['shape']} {entry['dtype']} (corrupt file?)")
        self._file.seek(self._data_start + begin)
        got = self._file.readinto(memoryview(t.view(-1).view(torch.uint8).numpy()))
        if got != end - begin:
            raise CheckpointError(f"could not read tensor {name!r} from {self.path}: the file ends early (truncated?)")
        return t

    def _mapped(self, name: str) -> torch.Tensor:
        try:
            return self._f.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"could not read tensor {name!r} from {self.path} "
                                  f"(corrupt or truncated?): {e}") from e

    def _header(self) -> dict:
        if self._entries is None:
            self._file = open(self.path, "rb")
            (n,) = struct.unpack("<Q", self._file.read(8))
            self._entries = json.loads(self._file.read(n))
            self._data_start = 8 + n
        return self._entries

    def close(self) -> None:
        self._f.__exit__(None, None, None)
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
