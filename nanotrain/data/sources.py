"""``--data`` to training data: a token stream (text, ``.bin``, ``.npy``) or instruction examples (chat JSONL).

Both kinds answer the same three questions, so a task never asks which it has: a loader of batches
(which describes itself in a line), a held-out split, and a fingerprint for the checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from nanotrain.data.batches import BlockLoader, ExampleLoader, PackedLoader, text_documents
from nanotrain.data.chat import ChatTemplate, Example, is_instruction_file, read_examples
from nanotrain.data.fingerprints import DataFingerprint, fingerprint
from nanotrain.data.text import STDLIB, load_tokens, source_file
from nanotrain.tokenizer import Tokenizer, end_of_text
from nanotrain.data.token_files import TOKEN_FILES, check_ids, open_token_file


def _cut(n: int, fraction: float) -> int:
    """Where the last ``fraction`` of ``n`` items starts: held out, the same every run."""
    if not 0 < fraction < 1:
        raise ValueError(f"--val-fraction {fraction} must be between 0 and 1 (e.g. 0.05)")
    return n - int(n * fraction)


@dataclass(frozen=True)
class TokenData:
    """A stream of token ids, cut into blocks of ``seq``, or its documents (each ending at ``eot``) packed."""
    source: str
    tokens: torch.Tensor
    eot: int | None = None  # the end-of-text id that ends each document (None: a token file, documents unknown)

    def loader(self, seq: int, batch: int, seed: int = 0, pack: bool | None = None) -> BlockLoader | PackedLoader:
        if not pack:
            return BlockLoader(self.tokens, seq, batch, seed)
        if self.eot is None:
            raise ValueError(f"--pack needs the documents' ends, which the token file {self.source} does not mark; "
                             f"give the text, or leave --pack out")
        return PackedLoader(text_documents(self.tokens, self.eot, seq), seq, batch, self.eot, seed)

    def split(self, fraction: float) -> tuple[TokenData, TokenData]:
        cut = _cut(len(self.tokens), fraction)
        return (TokenData(self.source, self.tokens[:cut], self.eot),
                TokenData(self.source, self.tokens[cut:], self.eot))

    def fingerprint(self) -> DataFingerprint:
        return fingerprint(self.source, self.tokens)


@dataclass(frozen=True)
class ExampleData:
    """Instruction examples, one per row, trained on the assistant's tokens only."""
    source: str
    examples: list[Example]
    pad_id: int

    def loader(self, seq: int, batch: int, seed: int = 0, pack: bool | None = None) -> ExampleLoader | PackedLoader:
        """Packed rows unless ``pack`` is False (None: packed)."""
        kind = ExampleLoader if pack is False else PackedLoader
        return kind(self.examples, seq, batch, self.pad_id, seed)

    def split(self, fraction: float) -> tuple[ExampleData, ExampleData]:
        cut = _cut(len(self.examples), fraction)
        return (ExampleData(self.source, self.examples[:cut], self.pad_id),
                ExampleData(self.source, self.examples[cut:], self.pad_id))

    def fingerprint(self) -> DataFingerprint:
        ids = torch.cat([e.ids for e in self.examples])
        return fingerprint(self.source, ids, torch.cat([e.trained for e in self.examples]),
                           torch.tensor([len(e.ids) for e in self.examples]))


TrainingData = TokenData | ExampleData


def open_data(source: str, tok: Tokenizer, vocab_size: int, data_dtype: str | None = None,
              template: ChatTemplate | None = None, cache_dir: str | Path = ".cache/tokens") -> TrainingData:
    """``source`` as training data for a model of ``vocab_size`` ids, refused in one line when it cannot be:
    a ``.bin``/``.npy`` token file (``data_dtype`` for ``.bin``, default uint16), an instruction JSONL
    (``prompt``/``response`` or ``messages``, rendered with ``template`` when given), else text."""
    path = Path(source)
    if path.suffix in TOKEN_FILES:
        return TokenData(source, open_token_file(path, vocab_size, data_dtype))
    if data_dtype is not None:
        raise ValueError(f"--data-dtype is for .bin token files, and {source} is not one")
    if source != STDLIB and is_instruction_file(source_file(source)):
        examples = read_examples(path, tok, template)
        check_ids(torch.cat([e.ids for e in examples]).numpy(), vocab_size, path)
        return ExampleData(source, examples, tok.eos_id or 0)  # padding is never a target
    tokens = load_tokens(source, tok, cache_dir)
    check_ids(tokens.numpy(), vocab_size, path)
    return TokenData(source, tokens, (end_of_text(tok) or [None])[0])
