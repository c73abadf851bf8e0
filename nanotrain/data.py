"""Text sources -> cached token arrays -> fixed-length training blocks in a seeded order."""
from __future__ import annotations

import array
import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import tiktoken
import torch

from nanotrain.loss import IGNORE_INDEX
from nanotrain.tokenizer import EOT

STDLIB = "stdlib"  # the Python standard library's own .py files: a code corpus on every machine


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def _source_file(source: str) -> Path:
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path} (give a text or .jsonl file, or 'stdlib' "
                                f"for the Python standard library's sources)")
    return path


def read_documents(source: str) -> list[str]:
    """``stdlib``, a ``.jsonl`` file (one ``{"text": ...}`` object or string per line) or any text file."""
    if source == STDLIB:
        return [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files()]
    path = _source_file(source)
    if path.suffix != ".jsonl":
        return [path.read_text(encoding="utf-8", errors="replace")]
    docs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from e
        if isinstance(obj, str):
            docs.append(obj)
        elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
            docs.append(obj["text"])
        else:
            raise ValueError(f"{path}:{n}: expected a JSON string or an object with a 'text' string")
    return docs


def _cache_key(source: str, tok: tiktoken.Encoding) -> str:
    if source == STDLIB:
        ident = f"stdlib:{sys.version}:{sysconfig.get_paths()['stdlib']}"
    else:
        path = _source_file(source)
        st = path.stat()
        ident = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha1(f"{ident}:{tok.name}:{tok.n_vocab}".encode()).hexdigest()[:16]


def load_tokens(source: str, tok: tiktoken.Encoding, cache_dir: str | Path = ".cache/tokens") -> torch.Tensor:
    """All documents of ``source`` tokenized, each followed by end-of-text, as a uint16 tensor.

    Tokenized once; later calls read ``cache_dir`` (keyed by file identity and tokenizer).
    """
    cache = Path(cache_dir) / f"{_cache_key(source, tok)}.u16"
    if not cache.exists():
        ids = array.array("H")
        for doc in tok.encode_ordinary_batch(read_documents(source)):
            ids.extend(doc)
            ids.append(EOT)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            ids.tofile(f)
        os.replace(tmp, cache)
    return torch.frombuffer(bytearray(cache.read_bytes()), dtype=torch.uint16)


@dataclass
class DataPosition:
    """Where a run is in its data: enough to resume the exact same batches."""
    epoch: int = 0
    index: int = 0


class BlockLoader:
    """Batches of ``batch`` blocks of ``seq`` tokens (+1 for the shifted targets), shuffled per epoch by seed."""

    def __init__(self, tokens: torch.Tensor, seq: int, batch: int, seed: int = 0, position: DataPosition | None = None):
        self.tokens, self.seq, self.batch, self.seed = tokens, seq, batch, seed
        self.num_blocks = (len(tokens) - 1) // seq
        if self.num_blocks < batch:
            raise ValueError(f"the corpus has {len(tokens)} tokens: {self.num_blocks} blocks of {seq}, fewer than "
                             f"one batch of {batch}; use a larger corpus, a shorter --seq or a smaller --batch")
        self.position = position or DataPosition()

    def _order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))

    def blocks(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = ids[:, None] * self.seq + torch.arange(self.seq + 1)
        chunk = self.tokens[starts.flatten()].long().view(len(ids), self.seq + 1)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [batch, seq] int64; an epoch drops its last partial batch."""
        pos = self.position
        if pos.index + self.batch > self.num_blocks:
            pos.epoch, pos.index = pos.epoch + 1, 0
        ids = self._order(pos.epoch)[pos.index:pos.index + self.batch]
        pos.index += self.batch
        return self.blocks(ids)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()


def random_windows(tokens: torch.Tensor, seq: int, batch: int, seed: int,
                   step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` windows of ``seq`` tokens at random starts and their next tokens, int64 [batch, seq].

    A pure function of ``(seed, step)``: every process of a parallel run draws the same batch
    without talking, and a run restarted at any step draws what it would have.
    """
    if len(tokens) < seq + 2:
        raise ValueError(f"the corpus has {len(tokens)} tokens, too few for windows of {seq}; use a larger corpus "
                         f"or a shorter --seq")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    idx = torch.randint(0, len(tokens) - seq - 1, (batch, 1), generator=gen) + torch.arange(seq)
    return tokens[idx].long(), tokens[idx + 1].long()


def pad_texts(texts: list[str], tok: tiktoken.Encoding, seq: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """One text per row, end-of-text appended, truncated or padded to ``seq`` with end-of-text.

    Targets are the inputs shifted by one, with padding marked ignored (-100) so it costs no loss.
    """
    inputs = torch.full((len(texts), seq), EOT, dtype=torch.long)
    targets = torch.full((len(texts), seq), IGNORE_INDEX, dtype=torch.long)
    for row, ids in enumerate(tok.encode_ordinary_batch(texts)):
        ids = (ids + [EOT])[:seq + 1]
        inputs[row, :len(ids) - 1] = torch.tensor(ids[:-1])
        targets[row, :len(ids) - 1] = torch.tensor(ids[1:])
    return inputs, targets
