"""Text corpora: documents read from files (refused when the file is not text) and the token cache.

A corpus is tokenized once; later runs map the cache file into memory (``token_files.map_tokens``),
so a corpus larger than RAM trains as well as a small one.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

from nanotrain.data.token_files import map_tokens, token_dtype
from nanotrain.tokenizer import Tokenizer, end_of_text

STDLIB = "stdlib"  # the Python standard library's own .py files: a code corpus on every machine
MAX_INVALID_UTF8 = 0.01  # a text with more invalid UTF-8 than 1 character in 100 is another encoding or binary


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def source_file(source: str) -> Path:
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path} (give a text, .jsonl, .bin or .npy file, or 'stdlib' "
                                f"for the Python standard library's sources)")
    return path


def read_text(path: Path) -> str:
    """The file decoded as UTF-8, refused in one line when it is not text (before any tokenizing):
    a NUL byte means a binary file, and much invalid UTF-8 another encoding whose letters would
    silently become replacement characters."""
    raw = path.read_bytes()
    nul = raw.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{path} is not text: NUL bytes ({raw.count(0)} of {len(raw)} bytes, the first at byte "
                         f"{nul}); token ids belong in a .bin (--data-dtype) or .npy file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        first = e.start
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    if bad > MAX_INVALID_UTF8 * len(text):
        raise ValueError(f"{path} is not UTF-8 text: {bad} of {len(text)} characters are invalid UTF-8, the first at "
                         f"byte {first}; convert it (e.g. iconv -f latin1 -t utf-8) or give a token file")
    return text


def read_documents(source: str) -> list[str]:
    """``stdlib``, a ``.jsonl`` file (one ``{"text": ...}`` object or string per line) or any text file."""
    if source == STDLIB:
        return [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files()]
    path = source_file(source)
    if path.suffix != ".jsonl":
        return [read_text(path)]
    docs = []
    for n, obj in read_jsonl(path):
        if isinstance(obj, str):
            docs.append(obj)
        elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
            docs.append(obj["text"])
        else:
            raise ValueError(f"{path}:{n}: expected a JSON string or an object with a 'text' string (or, for "
                             f"instruction data, 'prompt' and 'response' or 'messages')")
    return docs


def read_jsonl(path: Path) -> list[tuple[int, object]]:
    """(line number, object) for each non-empty line."""
    rows = []
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if line.strip():
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from e
    return rows


def _cache_key(source: str, tok: Tokenizer) -> str:
    """What the cached tokens are a function of: the text itself (its bytes' digest, not its path, size and
    modification time, which a copy with ``cp -p``, ``rsync -t`` or ``tar`` keeps for other bytes), the tokenizer
    (its name carries its file's digest) and what ends a document."""
    if source == STDLIB:
        ident = f"stdlib:{sys.version}:{sysconfig.get_paths()['stdlib']}"
    else:
        digest = hashlib.sha256()
        with open(source_file(source), "rb") as f:
            while chunk := f.read(1 << 24):  # a corpus larger than RAM hashes as well (about 1 s a GB)
                digest.update(chunk)
        ident = f"sha256:{digest.hexdigest()}"
    return hashlib.sha1(f"{ident}:{tok.name}:{tok.n_vocab}:{end_of_text(tok)}".encode()).hexdigest()[:16]


def load_tokens(source: str, tok: Tokenizer, cache_dir: str | Path = ".cache/tokens") -> torch.Tensor:
    """All documents of ``source`` tokenized, each followed by end-of-text, memory-mapped from the cache
    (uint16, or uint32 for a vocabulary over 65536 ids).

    Tokenized once; later calls map ``cache_dir``'s file (keyed by the text's digest and the tokenizer).
    """
    dtype = token_dtype(tok.n_vocab)
    cache = Path(cache_dir) / f"{_cache_key(source, tok)}.{dtype.name}"
    if not cache.exists():
        docs = read_documents(source)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            for ids in tok.encode_ordinary_batch(docs):
                np.asarray(ids + end_of_text(tok), dtype=dtype).tofile(f)
        os.replace(tmp, cache)
    return map_tokens(cache, dtype)
