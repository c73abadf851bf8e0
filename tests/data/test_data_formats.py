"""Data people bring: token files (.bin, .npy) memory-mapped and checked against the vocabulary, text that
is not text refused, the token cache for vocabularies over 65536 ids, and the data fingerprint."""
import os

import numpy as np
import pytest
import torch

from nanotrain.data import (BlockLoader, TokenData, fingerprint, load_tokens, open_data, open_token_file,
                            read_documents, what_changed)
from nanotrain.data.fingerprints import DataFingerprint

LLAMA3_VOCAB = 128256


class NumberTokenizer:
    """Each whitespace-separated word is its number: ids as large as a test wants, no files needed."""
    name, n_vocab, eos_id = "numbers", LLAMA3_VOCAB, LLAMA3_VOCAB - 1

    def encode_ordinary(self, text):
        return [int(w) for w in text.split()]

    encode = encode_ordinary

    def encode_ordinary_batch(self, texts):
        return [self.encode_ordinary(t) for t in texts]


def test_bin_is_uint16_by_default_and_uint32_when_told(tmp_path):
    ids = np.array([5, 0, 70000, 3, 128255], dtype=np.uint32)
    ids.astype(np.uint16).tofile(tmp_path / "u16.bin")  # 70000 wraps: not what a uint16 writer would keep
    (ids % 50000).astype(np.uint16).tofile(tmp_path / "gpt2.bin")
    ids.tofile(tmp_path / "u32.bin")
    assert open_token_file(tmp_path / "gpt2.bin", 50257).tolist() == (ids % 50000).tolist()
    t = open_token_file(tmp_path / "u32.bin", LLAMA3_VOCAB, "uint32")
    assert t.dtype == torch.uint32 and t.long().tolist() == ids.tolist()
    with pytest.raises(ValueError, match=r"u16.bin holds uint16 ids \(at most 65535\), too narrow for the model's "
                                         r"vocabulary of 128256: .*--data-dtype uint32"):
        open_token_file(tmp_path / "u16.bin", LLAMA3_VOCAB)
    with pytest.raises(ValueError, match=r"u32.bin: token id 70000 at position 2 is outside the model's vocabulary "
                                         r"\[0, 50257\)"):
        open_token_file(tmp_path / "u32.bin", 50257, "uint32")


def test_bin_refusals_name_the_file_and_the_fix(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match=r"odd.bin has 3 bytes, not a whole number of uint16 ids \(2 bytes each\)"):
        open_token_file(tmp_path / "odd.bin", 50257)
    np.arange(1000, dtype=np.uint32).tofile(tmp_path / "wide.bin")  # uint32 ids read as uint16: 0 every other id
    with pytest.raises(ValueError, match=r"wide.bin: every other id is 0, .*pass --data-dtype uint32"):
        open_token_file(tmp_path / "wide.bin", 50257)
    assert open_token_file(tmp_path / "wide.bin", 50257, "uint32").long().tolist() == list(range(1000))
    with pytest.raises(ValueError, match=r"--data-dtype int8: a .bin token file is one of uint16, uint32"):
        open_token_file(tmp_path / "wide.bin", 50257, "int8")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.bin holds no tokens"):
        open_token_file(tmp_path / "empty.bin", 50257)
    late = np.full(300_000, 7, dtype=np.uint16)
    late[123_457] = 60000
    late.tofile(tmp_path / "late.bin")  # past the first chunk: every id of a small file is checked
    with pytest.raises(ValueError, match=r"token id 60000 at position 123457 is outside .* another tokenizer"):
        open_token_file(tmp_path / "late.bin", 50257)


def test_npy_takes_its_dtype_from_its_header(tmp_path):
    np.save(tmp_path / "t.npy", np.array([1, 2, 128000], dtype=np.uint32))
    t = open_token_file(tmp_path / "t.npy", LLAMA3_VOCAB)
    assert t.dtype == torch.uint32 and t.long().tolist() == [1, 2, 128000]
    with pytest.raises(ValueError, match=r"--data-dtype uint16, but .*t.npy holds uint32"):
        open_token_file(tmp_path / "t.npy", LLAMA3_VOCAB, "uint16")
    np.save(tmp_path / "f.npy", np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match=r"f.npy holds a float32 array of shape \(2, 3\); token files are 1-D"):
        open_token_file(tmp_path / "f.npy", 50257)
    np.save(tmp_path / "neg.npy", np.array([4, -1, 2], dtype=np.int32))
    with pytest.raises(ValueError, match=r"token id -1 at position 1"):
        open_token_file(tmp_path / "neg.npy", 50257)


def _rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_blocks_come_from_the_map_without_reading_the_file(tmp_path, suffix):
    """A 1 GiB file (sparse: zeros, which are valid ids) gives batches while this process's resident memory
    grows by far less than the file: the tensor is the map, and a batch reads only its blocks' pages."""
    path = tmp_path / f"big{suffix}"
    n = (1 << 30) // 2
    if suffix == ".npy":
        np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(n,)).flush()
    else:
        with open(path, "wb") as f:
            f.truncate(n * 2)
    rss0 = _rss_bytes()
    tokens = open_token_file(path, 50257)
    assert len(tokens) == n and tokens.dtype == torch.uint16
    assert not tokens.untyped_storage().resizable()  # not a copy torch owns: the file's map
    x, y = BlockLoader(tokens, seq=64, batch=4, seed=0).next_batch()
    assert x.shape == y.shape == (4, 64) and not x.any()
    assert _rss_bytes() - rss0 < (1 << 30) // 8


def test_blocks_of_a_mapped_file_equal_those_of_the_tensor(tmp_path):
    ids = torch.randint(0, 50257, (10_000,), generator=torch.Generator().manual_seed(0))
    ids.numpy().astype(np.uint16).tofile(tmp_path / "d.bin")
    mapped, plain = open_token_file(tmp_path / "d.bin", 50257), ids.to(torch.uint16)
    for (a, b), (c, d) in zip(BlockLoader(mapped, 32, 8, seed=1), BlockLoader(plain, 32, 8, seed=1)):
        assert torch.equal(a, c) and torch.equal(b, d)
        break


def test_text_that_is_not_text_is_refused_before_tokenizing(tmp_path):
    (tmp_path / "weights.txt").write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"weights.txt is not text: NUL bytes \(4 of 1028 bytes, the first at byte "
                                         r"4\); token ids belong in a .bin"):
        read_documents(str(tmp_path / "weights.txt"))
    (tmp_path / "latin1.txt").write_bytes("Où est la bibliothèque? À côté du café. ".encode("latin-1") * 50)
    with pytest.raises(ValueError, match=r"latin1.txt is not UTF-8 text: 300 of 2000 characters are invalid UTF-8, "
                                         r"the first at byte 1; convert it \(e.g. iconv"):
        read_documents(str(tmp_path / "latin1.txt"))
    (tmp_path / "nul.jsonl").write_bytes(b'{"text": "a"}\n\x00\x00')
    with pytest.raises(ValueError, match=r"nul.jsonl is not text"):
        read_documents(str(tmp_path / "nul.jsonl"))
    (tmp_path / "one_bad_byte.txt").write_bytes(b"plain text " * 100 + b"\xff")  # under 1%: kept, as read
    assert read_documents(str(tmp_path / "one_bad_byte.txt"))[0].endswith("text \ufffd")


def test_token_cache_holds_ids_over_65535(tmp_path):
    (tmp_path / "c.txt").write_text("1 70000 128254\n")
    tok = NumberTokenizer()
    tokens = load_tokens(str(tmp_path / "c.txt"), tok, tmp_path / "cache")
    assert tokens.dtype == torch.uint32 and tokens.long().tolist() == [1, 70000, 128254, tok.eos_id]
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".uint32"]
    with pytest.raises(ValueError, match=r"c.txt: token id 70000 at position 1 is outside the model's vocabulary"):
        open_data(str(tmp_path / "c.txt"), tok, 50257, cache_dir=tmp_path / "cache")


def test_the_token_cache_serves_what_the_text_is_never_stale_tokens(tmp_path):
    """A corpus replaced by other text of the same size and modification time (``cp -p``, ``rsync -t``, ``tar``
    keep them) is tokenized again; the same text elsewhere, or touched, maps the cache it made."""
    corpus, tok = tmp_path / "c.txt", NumberTokenizer()
    corpus.write_text("1 2 3\n")
    assert load_tokens(str(corpus), tok, tmp_path / "cache").long().tolist() == [1, 2, 3, tok.eos_id]
    stamp = corpus.stat().st_mtime_ns
    corpus.write_text("4 5 6\n")  # the same size
    os.utime(corpus, ns=(stamp, stamp))  # and time
    assert load_tokens(str(corpus), tok, tmp_path / "cache").long().tolist() == [4, 5, 6, tok.eos_id]
    (tmp_path / "copy.txt").write_text("4 5 6\n")
    assert load_tokens(str(tmp_path / "copy.txt"), tok, tmp_path / "cache").long().tolist() == [4, 5, 6, tok.eos_id]
    assert len(list((tmp_path / "cache").iterdir())) == 2  # one per text, not per file


def test_open_data_picks_the_kind_by_the_file(tmp_path, tokenizer):
    np.array([1, 2, 3], dtype=np.uint16).tofile(tmp_path / "t.bin")
    data = open_data(str(tmp_path / "t.bin"), tokenizer, 50257)
    assert isinstance(data, TokenData) and data.tokens.tolist() == [1, 2, 3]
    (tmp_path / "t.txt").write_text("hello world")
    assert open_data(str(tmp_path / "t.txt"), tokenizer, 50257, cache_dir=tmp_path).tokens.tolist() == [
        31373, 995, 50256]
    with pytest.raises(ValueError, match=r"--data-dtype is for .bin token files, and .*t.txt is not one"):
        open_data(str(tmp_path / "t.txt"), tokenizer, 50257, data_dtype="uint32")
    train, held = open_data(str(tmp_path / "t.txt"), tokenizer, 50257, cache_dir=tmp_path).split(0.34)
    assert (train.tokens.tolist(), held.tokens.tolist()) == ([31373, 995], [50256])


def test_fingerprint_says_what_changed(tmp_path):
    path = tmp_path / "d.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    saved = open_data(str(path), None, 50257).fingerprint()
    assert DataFingerprint.from_json(saved.to_json()) == saved
    os.utime(path, ns=(0, saved.mtime_ns + 10**9))  # touched, same bytes: the same data
    assert what_changed(saved, open_data(str(path), None, 50257).fingerprint()) is None
    ids = np.arange(100, dtype=np.uint16)
    ids[50] = 7
    ids.tofile(path)
    os.utime(path, ns=(0, saved.mtime_ns))  # edited in place, its time put back: only the tokens tell
    assert what_changed(saved, open_data(str(path), None, 50257).fingerprint()) == (
        f"the training data differs from the checkpoint's: {path}: the same file and token count but other tokens "
        f"(another tokenizer, chat template or dtype)")
    np.arange(120, dtype=np.uint16).tofile(path)
    line = what_changed(saved, open_data(str(path), None, 50257).fingerprint())
    assert line.startswith(f"the training data differs from the checkpoint's: {path}: 240 bytes, was 200; "
                           f"modified ") and line.endswith("; 120 tokens, was 100")
    assert "\n" not in line
    t = torch.arange(10)
    assert fingerprint("stdlib", t).size is None and fingerprint("stdlib", t) != fingerprint("stdlib", t + 1)


def test_a_large_corpus_is_fingerprinted_by_samples_and_its_file_times(tmp_path, monkeypatch):
    from nanotrain.data import fingerprints as fp

    monkeypatch.setattr(fp, "HASH_ALL_BYTES", 1 << 20)
    monkeypatch.setattr(fp, "SAMPLE_BYTES", 1 << 10)
    path = tmp_path / "d.bin"
    np.zeros(1 << 20, dtype=np.uint16).tofile(path)
    saved = open_data(str(path), None, 50257).fingerprint()
    assert saved.sampled and what_changed(saved, open_data(str(path), None, 50257).fingerprint()) is None
    os.utime(path, ns=(0, saved.mtime_ns + 10**9))  # unsampled bytes may have changed: the time says so
    assert "modified" in what_changed(saved, open_data(str(path), None, 50257).fingerprint())
    ids = np.zeros(1 << 20, dtype=np.uint16)
    ids[-1] = 1
    ids.tofile(path)  # a sampled byte changed
    os.utime(path, ns=(0, saved.mtime_ns))
    assert what_changed(saved, open_data(str(path), None, 50257).fingerprint()).endswith("other tokens (another "
                                                                                         "tokenizer, chat template "
                                                                                         "or dtype)")
