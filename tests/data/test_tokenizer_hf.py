"""A model's own tokenizer.json (trained here with the ``tokenizers`` trainer, no network): ids, BOS and EOS as
transformers finds them, and a tokenizer larger than the model's embedding refused in one line."""
import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from nanotrain.tokenizer import HFTokenizer, TokenizerError, load_tokenizer

TEXTS = ["The quick brown fox jumps over the lazy dog.", "To be, or not to be, that is the question."] * 20


def write_tokenizer(folder, vocab_size: int = 300, config: dict | None = None) -> None:
    """A byte-level BPE with <s> and </s>, whose post-processor puts <s> before a text (as Llama's does)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}} if config is None else config
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_ids_bos_and_eos_as_transformers_reads_them(tmp_path):
    write_tokenizer(tmp_path)
    ours, theirs = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    text = "The lazy fox, or not the fox?"
    assert ours.encode(text) == theirs(text)["input_ids"] and ours.encode(text)[0] == ours.bos_id == 0
    assert ours.encode_ordinary(text) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.encode_ordinary_batch([text, "dog"]) == [ours.encode_ordinary(text), ours.encode_ordinary("dog")]
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id) == (0, 1)
    assert ours.decode(ours.encode_ordinary(text)) == text
    assert ours.n_vocab == len(theirs) == 300


def test_special_tokens_map_overrides_and_generation_config_fills_in(tmp_path):
    write_tokenizer(tmp_path, config={"bos_token": "</s>"})
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<s>"}}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [1, 0]}))
    tok = HFTokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (0, 1)


def test_two_tokenizers_name_their_token_caches_apart(tmp_path):
    write_tokenizer(tmp_path / "a", vocab_size=300)
    write_tokenizer(tmp_path / "b", vocab_size=280)
    assert HFTokenizer(tmp_path / "a").name != HFTokenizer(tmp_path / "b").name


def test_bad_tokenizer_folders(tmp_path):
    with pytest.raises(TokenizerError, match=r"holds neither a tokenizer.json nor GPT-2's vocab.bpe and encoder.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{")
    with pytest.raises(TokenizerError, match=r"tokenizer.json is not a readable tokenizer"):
        load_tokenizer(tmp_path)
    write_tokenizer(tmp_path, config={"eos_token": "<|end|>"})
    with pytest.raises(TokenizerError, match=r"the eos_token '<\|end\|>' of its tokenizer files is not in "
                                             r"tokenizer.json"):
        load_tokenizer(tmp_path)
