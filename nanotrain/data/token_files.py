"""Pre-tokenized corpora: nanoGPT's flat ``.bin`` files and ``.npy`` arrays, memory-mapped, never read whole.

A ``.bin`` file says nothing about itself: its ids are ``uint16`` unless ``--data-dtype uint32`` says
otherwise (nanoGPT's ``prepare.py`` writes uint16, enough for GPT-2's 50257 ids; a vocabulary over
65536 ids, such as Llama 3's 128256, needs uint32). A ``.npy`` file carries its dtype in its header.

Before training, the ids are checked against the model's vocabulary: the dtype must be able to hold
every id, and a sample of the file (all of it when small) must lie in ``[0, vocab)``. An id the sample
missed is still refused by the step that would read it (``models.run.validate_tokens``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

TOKEN_FILES = (".bin", ".npy")
BIN_DTYPES = ("uint16", "uint32")
DEFAULT_BIN_DTYPE = "uint16"  # nanoGPT's
SAMPLE_CHUNKS, CHUNK_TOKENS = 64, 1 << 16  # ids checked: all of a file up to 4M tokens, else 64 spread chunks


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def map_tokens(path: Path, dtype: np.dtype | str) -> torch.Tensor:
    """The file's ids as a tensor over a copy-on-write map: pages are read when a batch touches them,
    and the file is never written (torch wants a writable array; the map's writes stay private)."""
    dtype = np.dtype(dtype)
    size = path.stat().st_size
    if size <= 0:
        raise ValueError(f"{path} holds no tokens")
    return torch.from_numpy(np.memmap(path, dtype=dtype, mode="c", shape=(size // dtype.itemsize,)))


def open_token_file(source: str | Path, vocab_size: int, dtype: str | None = None) -> torch.Tensor:
    """A ``.bin`` (``dtype``, default uint16) or ``.npy`` file of token ids, mapped and checked."""
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"token file not found: {path}")
    if path.suffix == ".npy":
        tokens = _map_npy(path, dtype)
    elif path.suffix == ".bin":
        dt = np.dtype(dtype or DEFAULT_BIN_DTYPE)
        if dt.name not in BIN_DTYPES:
            raise ValueError(f"--data-dtype {dt.name}: a .bin token file is one of {', '.join(BIN_DTYPES)}")
        size = path.stat().st_size
        if size % dt.itemsize:
            raise ValueError(f"{path} has {size} bytes, not a whole number of {dt.name} ids ({dt.itemsize} bytes "
                             f"each): a truncated file, or another dtype?")
        tokens = map_tokens(path, dt)
    else:
        raise ValueError(f"{path}: token files end in {' or '.join(TOKEN_FILES)}")
    check_dtype(tokens.numpy(), vocab_size, path, given=dtype is not None or path.suffix == ".npy")
    check_ids(tokens.numpy(), vocab_size, path)
    return tokens


def _map_npy(path: Path, dtype: str | None) -> torch.Tensor:
    """The array of a ``.npy`` file, mapped at its header's offset (``np.load(mmap_mode=...)``)."""
    arr = np.load(path, mmap_mode="c")
    if arr.ndim != 1 or arr.dtype.kind not in "ui":
        raise ValueError(f"{path} holds a {arr.dtype} array of shape {arr.shape}; token files are 1-D integer "
                         f"arrays (np.uint16 or np.uint32)")
    if dtype is not None and np.dtype(dtype) != arr.dtype:
        raise ValueError(f"--data-dtype {dtype}, but {path} holds {arr.dtype} (a .npy file says its own dtype: "
                         f"drop --data-dtype)")
    return torch.from_numpy(arr)


def check_dtype(ids: np.ndarray, vocab_size: int, path: Path, given: bool) -> None:
    """Refuse a dtype too narrow for the vocabulary; and, when the dtype is ``.bin``'s default (not
    ``given``), a file that reads like uint32 ids taken two bytes at a time."""
    if ids.dtype.kind == "u" and np.iinfo(ids.dtype).max < vocab_size - 1:
        raise ValueError(f"{path} holds {ids.dtype} ids (at most {np.iinfo(ids.dtype).max}), too narrow for the "
                         f"model's vocabulary of {vocab_size}: write the tokens as uint32 (and pass --data-dtype "
                         f"uint32 for a .bin)")
    head = np.asarray(ids[:CHUNK_TOKENS])
    if not given and len(head) >= 64 and ids.dtype == np.uint16 and not head[1::2].any() and head[::2].any():
        raise ValueError(f"{path}: every other id is 0, as uint32 ids read as uint16 look (.bin files are read as "
                         f"uint16 unless told): pass --data-dtype uint32")


def check_ids(ids: np.ndarray, vocab_size: int, path: Path) -> None:
    """Refuse, in one line naming the file and the first offending position, a sampled id outside the
    vocabulary (all ids of a file up to ``SAMPLE_CHUNKS * CHUNK_TOKENS``)."""
    for start in _sample_starts(len(ids)):
        chunk = np.asarray(ids[start:start + CHUNK_TOKENS])
        bad = np.flatnonzero((chunk >= vocab_size) | (chunk < 0))
        if len(bad):
            pos = start + int(bad[0])
            hint = (" (uint16 ids read as uint32? then drop --data-dtype)" if ids.dtype == np.uint32
                    and vocab_size <= 1 << 16 else "; was it written with another tokenizer?")
            raise ValueError(f"{path}: token id {int(ids[pos])} at position {pos} is outside the model's vocabulary "
                             f"[0, {vocab_size}){hint}")


def _sample_starts(n: int) -> range | np.ndarray:
    """Chunk starts covering the whole file when small, else first, last and evenly spread chunks."""
    if n <= SAMPLE_CHUNKS * CHUNK_TOKENS:
        return range(0, n, CHUNK_TOKENS)
    return np.linspace(0, n - CHUNK_TOKENS, SAMPLE_CHUNKS).astype(np.int64)
