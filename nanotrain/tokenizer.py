"""The GPT-2 BPE tokenizer (tiktoken ``gpt2``), from the network, tiktoken's cache or local files."""
from __future__ import annotations

import functools
from pathlib import Path

import tiktoken

EOT = 50256  # <|endoftext|>
_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


class TokenizerError(RuntimeError):
    pass


@functools.lru_cache(maxsize=4)
def get_tokenizer(files_dir: str | None = None) -> tiktoken.Encoding:
    """tiktoken's ``gpt2`` encoding; with ``files_dir``, built offline from ``vocab.bpe`` and ``encoder.json`` there.

    The local files are checked against the same SHA-256 hashes tiktoken pins for its download.
    """
    if files_dir is not None:
        d = Path(files_dir)
        missing = [n for n in ("vocab.bpe", "encoder.json") if not (d / n).is_file()]
        if missing:
            raise TokenizerError(f"tokenizer folder {d} lacks {', '.join(missing)}; it needs the GPT-2 files "
                                 f"vocab.bpe and encoder.json")
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

        try:
            ranks = data_gym_to_mergeable_bpe_ranks(str(d / "vocab.bpe"), str(d / "encoder.json"),
                                                    _VOCAB_BPE_SHA256, _ENCODER_JSON_SHA256)
        except ValueError as e:
            raise TokenizerError(f"tokenizer files in {d} are not the GPT-2 ones (hash mismatch): {e}") from e
        return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={ENDOFTEXT: EOT}, explicit_n_vocab=50257)
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # network errors come in many types (requests, ssl, DNS)
        raise TokenizerError(
            f"could not load the GPT-2 tokenizer ({type(e).__name__}): tiktoken downloads vocab.bpe and "
            f"encoder.json on first use, and this machine could not. Offline, pass --tokenizer-dir DIR "
            f"holding those two files (e.g. ../shared/data/gpt2-tokenizer), or put them in $TIKTOKEN_CACHE_DIR "
            f"under tiktoken's cache names") from e


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256): a tokenizer that needs no files, for small demos."""

    name = "bytes"
    n_vocab = 256

    def encode_ordinary(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode_ordinary(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")
