"""Tokenizers behind one small interface (``Tokenizer``): a model's own ``tokenizer.json`` (the ``tokenizers``
package, as ``transformers`` reads it) and GPT-2's BPE (tiktoken ``gpt2``, from the network, tiktoken's cache
or local files).
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Protocol

import tiktoken

EOT = 50256  # GPT-2's <|endoftext|>
_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
BPE_FILES = ("vocab.bpe", "encoder.json")


class TokenizerError(RuntimeError):
    pass


class Tokenizer(Protocol):
    """What the data loader and generation use of a tokenizer."""

    name: str               # names the token caches, with ``n_vocab``
    n_vocab: int            # one more than the largest id: the embedding needs at least this many rows
    bos_id: int | None
    eos_id: int | None      # ends a document in the corpora

    def encode(self, text: str) -> list[int]:
        """Ids as the model's own tokenizer gives a prompt: with the special tokens it adds (a BOS)."""

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of the text alone, no special tokens added."""

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of a rendered chat template: its special-token strings (``<|im_end|>``) become their ids, and
        nothing is added (the template wrote the BOS it wants, as ``apply_chat_template`` encodes)."""

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


def end_of_text(tok: Tokenizer) -> list[int]:
    """What closes a document in a corpus: the tokenizer's EOS, or nothing when it has none."""
    return [] if tok.eos_id is None else [tok.eos_id]


class BPETokenizer:
    """GPT-2's BPE through tiktoken; ``<|endoftext|>`` is both its BOS and EOS (as in ``transformers``), and
    encoding adds neither."""

    bos_id = eos_id = EOT

    def __init__(self, encoding: tiktoken.Encoding):
        self._enc = encoding
        self.name, self.n_vocab = encoding.name, encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_ordinary(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_rendered(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


@functools.lru_cache(maxsize=4)
def get_tokenizer(files_dir: str | None = None) -> BPETokenizer:
    """GPT-2's BPE; with ``files_dir``, built offline from ``vocab.bpe`` and ``encoder.json`` there.

    The local files are checked against the same SHA-256 hashes tiktoken pins for its download.
    """
    if files_dir is not None:
        d = Path(files_dir)
        missing = [n for n in BPE_FILES if not (d / n).is_file()]
        if missing:
            raise TokenizerError(f"tokenizer folder {d} lacks {', '.join(missing)}; it needs the GPT-2 files "
                                 f"vocab.bpe and encoder.json (or a model's tokenizer.json)")
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

        try:
            ranks = data_gym_to_mergeable_bpe_ranks(str(d / "vocab.bpe"), str(d / "encoder.json"),
                                                    _VOCAB_BPE_SHA256, _ENCODER_JSON_SHA256)
        except ValueError as e:
            raise TokenizerError(f"tokenizer files in {d} are not the GPT-2 ones (hash mismatch): {e}") from e
        return BPETokenizer(tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                              special_tokens={ENDOFTEXT: EOT}, explicit_n_vocab=50257))
    try:
        return BPETokenizer(tiktoken.get_encoding("gpt2"))
    except Exception as e:  # network errors come in many types (requests, ssl, DNS)
        raise TokenizerError(
            f"could not load the GPT-2 tokenizer ({type(e).__name__}): tiktoken downloads vocab.bpe and "
            f"encoder.json on first use, and this machine could not. Offline, pass --tokenizer-dir DIR "
            f"holding those two files (e.g. ../shared/data/gpt2-tokenizer), or put them in $TIKTOKEN_CACHE_DIR "
            f"under tiktoken's cache names") from e


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except ValueError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from e


def _token(value: object) -> str | None:
    """A special token as the tokenizer files write it: a string, or an ``AddedToken`` dict with its content."""
    return value.get("content") if isinstance(value, dict) else value  # type: ignore[return-value]


def _first(value: object) -> int | None:
    """``generation_config.json``'s id: one, or a list whose first is the main one."""
    return value[0] if isinstance(value, list) and value else value if isinstance(value, int) else None


class HFTokenizer:
    """A model's ``tokenizer.json`` with its BOS and EOS found as ``transformers`` finds them:
    ``tokenizer_config.json``, overridden by ``special_tokens_map.json``; ``generation_config.json``'s ids
    where neither names the token."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        try:
            self._tok = Backend.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the Rust side raises plain Exceptions for every parse error
            raise TokenizerError(f"{folder / 'tokenizer.json'} is not a readable tokenizer: {e}") from e
        # the token caches are keyed by the name: the file's digest tells two tokenizers apart
        self.name = "tokenizer.json-" + hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()[:16]
        self.n_vocab = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        named = _json(folder / "tokenizer_config.json") | _json(folder / "special_tokens_map.json")
        generation = _json(folder / "generation_config.json")
        self.bos_id = self._id(named, generation, "bos", folder)
        self.eos_id = self._id(named, generation, "eos", folder)

    def _id(self, named: dict, generation: dict, kind: str, folder: Path) -> int | None:
        token = _token(named.get(f"{kind}_token"))
        if token is None:
            return _first(generation.get(f"{kind}_token_id"))
        found = self._tok.token_to_id(token)
        if found is None:
            raise TokenizerError(f"{folder}: the {kind}_token {token!r} of its tokenizer files is not in "
                                 f"tokenizer.json")
        return found

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_ordinary(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_rendered(self, text: str) -> list[int]:
        return self.encode_ordinary(text)  # tokenizers reads added special tokens in the text as their ids

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer in ``folder``: a model's ``tokenizer.json``, or GPT-2's ``vocab.bpe`` and ``encoder.json``."""
    d = Path(folder)
    if (d / "tokenizer.json").is_file():
        return HFTokenizer(d)
    if all((d / n).is_file() for n in BPE_FILES):
        return get_tokenizer(str(d))
    raise TokenizerError(f"tokenizer folder {d} holds neither a tokenizer.json nor GPT-2's vocab.bpe and encoder.json")
