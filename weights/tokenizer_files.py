"""A model's tokenizer and generation settings as a Hugging Face folder holds them, so that
``transformers.AutoTokenizer`` and ``generate`` read a folder we wrote: the files of a tokenizer folder copied
(``tokenizer.json``, its config, the chat template, ``generation_config.json``), or GPT-2's BPE (tiktoken's
``vocab.bpe`` and ``encoder.json``) written as the ``tokenizer.json`` those files make, and a
``generation_config.json`` from the tokenizer's BOS and EOS where the folder brought none.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from nanotrain.tokenizer import BPE_FILES, get_tokenizer, load_tokenizer
from weights.files import write_text

# What transformers' tokenizers and generation read beside the weights (the chat template: a file of its own
# since transformers 4.47, else in tokenizer_config.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json")
GENERATION_CONFIG = "generation_config.json"
_GPT2_SPECIAL = "<|endoftext|>"


def copy_tokenizer(src: str | Path, out_dir: str | Path) -> list[Path]:
    """Copy the Hugging Face tokenizer files of ``src`` (those there are) into ``out_dir``."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            dest, tmp = Path(out_dir) / name, Path(out_dir) / f".{name}.tmp-{os.getpid()}"
            shutil.copyfile(Path(src) / name, tmp)
            os.replace(tmp, dest)
            copied.append(dest)
    return copied


def write_gpt2_tokenizer(bpe_dir: str | Path, out_dir: str | Path, n_ctx: int) -> list[Path]:
    """GPT-2's BPE files in ``bpe_dir`` (checked against the hashes tiktoken pins) as ``tokenizer.json`` and
    ``tokenizer_config.json`` in ``out_dir``: the byte-level BPE of those merges and that vocabulary, with
    ``<|endoftext|>`` its one special token, as BOS, EOS and UNK (``transformers``' GPT-2 tokenizer), for a model
    of ``n_ctx`` positions. It encodes every text to tiktoken's ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    get_tokenizer(str(bpe_dir))  # the files are GPT-2's own, or a TokenizerError says they are not
    vocab, merges = (str(Path(bpe_dir) / name) for name in ("encoder.json", "vocab.bpe"))
    tok = Tokenizer(models.BPE.from_file(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split pattern, then bytes
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(_GPT2_SPECIAL, special=True)])
    out_dir = Path(out_dir)
    written = write_text(out_dir / "tokenizer.json", tok.to_str())
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": _GPT2_SPECIAL, "eos_token": _GPT2_SPECIAL,
              "unk_token": _GPT2_SPECIAL, "add_prefix_space": False, "model_max_length": n_ctx}
    return [written, write_text(out_dir / "tokenizer_config.json", json.dumps(config, indent=2))]


def write_tokenizer(source: str | Path, out_dir: str | Path, n_ctx: int) -> list[Path]:
    """The tokenizer in ``source`` (a folder with a ``tokenizer.json``, or GPT-2's ``vocab.bpe`` and
    ``encoder.json``) as Hugging Face files in ``out_dir``."""
    if not (Path(source) / "tokenizer.json").is_file() and all((Path(source) / n).is_file() for n in BPE_FILES):
        return write_gpt2_tokenizer(source, out_dir, n_ctx)
    return copy_tokenizer(source, out_dir)


def write_generation_config(out_dir: str | Path, config: dict[str, Any]) -> Path | None:
    """``generation_config.json`` in ``out_dir`` where the tokenizer files brought none: the BOS and EOS of the
    tokenizer there (or of ``config``, the model's ``config.json``, without one), as ``transformers`` derives it
    from a model's config. None: one was there already."""
    out_dir = Path(out_dir)
    if (out_dir / GENERATION_CONFIG).is_file():
        return None
    tok = load_tokenizer(out_dir) if (out_dir / "tokenizer.json").is_file() else None
    ids = {}
    for kind, found in (("bos", tok and tok.bos_id), ("eos", tok and tok.eos_id)):
        value = found if found is not None else config.get(f"{kind}_token_id")
        if value is not None:
            ids[f"{kind}_token_id"] = value
    return write_text(out_dir / GENERATION_CONFIG, json.dumps(ids, indent=2))
