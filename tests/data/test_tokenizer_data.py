"""Tokenizer (offline from shared files) and the data pipeline."""
import json
import os
import subprocess
import sys

import pytest
import torch

from nanotrain.data import BlockLoader, DataPosition, load_tokens, read_documents, stdlib_files
from nanotrain.tokenizer import EOT, TokenizerError, get_tokenizer
from tests.conftest import SHAKESPEARE


def test_gpt2_encodings(tokenizer):
    assert tokenizer.encode("A cat sat") == [32, 3797, 3332]
    assert tokenizer.encode("import numpy") == [11748, 299, 32152]
    assert tokenizer.n_vocab == 50257 and tokenizer.eos_id == tokenizer.bos_id == EOT


def test_tokenizer_folder_without_files(tmp_path):
    with pytest.raises(TokenizerError, match=r"lacks vocab.bpe, encoder.json"):
        get_tokenizer(str(tmp_path))


def test_tokenizer_without_network_says_how_to_fix(tmp_path):
    # A proxy on a closed port makes the download fail at once, as it does on an offline machine.
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path), HTTPS_PROXY="http://127.0.0.1:9",
               HTTP_PROXY="http://127.0.0.1:9", NO_PROXY="")
    code = "from nanotrain.tokenizer import get_tokenizer; get_tokenizer()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--tokenizer-dir" in r.stderr, r.stderr[-2000:]


def test_jsonl_and_text_sources(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps("two") + "\n")
    assert read_documents(str(p)) == ["one", "two"]
    p.write_text('{"body": 1}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: expected a JSON string or an object with a 'text' string"):
        read_documents(str(p))
    with pytest.raises(FileNotFoundError, match=r"data file not found: .*missing.txt"):
        read_documents(str(tmp_path / "missing.txt"))


def test_missing_data_file_for_training(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data file not found: .*missing.jsonl .*'stdlib'"):
        load_tokens(str(tmp_path / "missing.jsonl"), tokenizer, tmp_path)


def test_stdlib_corpus_exists_everywhere():
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)


def test_tokens_are_cached_and_blocks_shift_by_one(tokenizer, tmp_path):
    if not SHAKESPEARE.exists():
        pytest.skip("tinyshakespeare not found")
    tokens = load_tokens(str(SHAKESPEARE), tokenizer, tmp_path)
    assert len(list(tmp_path.iterdir())) == 1
    assert torch.equal(tokens, load_tokens(str(SHAKESPEARE), tokenizer, tmp_path))
    assert tokens[-1].item() == EOT and len(tokens) > 300_000
    x, y = BlockLoader(tokens, seq=32, batch=4, seed=0).next_batch()
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])


def test_shuffle_is_deterministic_and_resumable():
    tokens = torch.arange(1000).to(torch.uint16)
    a = BlockLoader(tokens, seq=10, batch=8, seed=3)
    batches = [a.next_batch()[0] for _ in range(30)]  # crosses epoch boundaries (99 blocks)
    b = BlockLoader(tokens, seq=10, batch=8, seed=3)
    assert all(torch.equal(x, b.next_batch()[0]) for x in batches[:10])
    resumed = BlockLoader(tokens, seq=10, batch=8, seed=3)
    resumed.position = DataPosition(**vars(b.position))
    assert all(torch.equal(x, resumed.next_batch()[0]) for x in batches[10:])
    assert not torch.equal(batches[0], BlockLoader(tokens, seq=10, batch=8, seed=4).next_batch()[0])


def test_corpus_too_small_for_a_batch():
    with pytest.raises(ValueError, match="fewer than one batch of 64"):
        BlockLoader(torch.zeros(100, dtype=torch.uint16), seq=10, batch=64)
