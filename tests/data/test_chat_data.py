"""Instruction data: prompt/response and chat JSONL, rendered with a chat template as ``transformers`` renders
it (or the plain join), trained on the assistant's tokens only, one example per padded row."""
import json

import pytest
import torch

from nanotrain.core import models
from nanotrain.data import ExampleData, encode_conversation, open_data, read_chat_template
from nanotrain.data.batches import IGNORE_INDEX
from nanotrain.core.tree import named_leaves
from tests.conftest import chain_rtol, model_chain
TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'assistant' %}
    {{- raise_exception('Conversations start with the user or the system') }}
{%- endif %}
{%- for m in messages %}
    {%- if m['role'] == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}

    {%- else %}
<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>

    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
SPECIALS = ["<s>", "<|im_start|>", "<|im_end|>"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "ok"}]


class WordTokenizer:
    """A ``tokenizers`` word-level tokenizer with ChatML's special tokens: the fake with a chat template."""
    name = "words"

    def __init__(self, words):
        from tokenizers import Tokenizer, models as tm, pre_tokenizers
        vocab = {w: i for i, w in enumerate(SPECIALS + ["[UNK]"] + sorted(set(words)))}
        self.tk = Tokenizer(tm.WordLevel(vocab, unk_token="[UNK]"))
        self.tk.pre_tokenizer = pre_tokenizers.Whitespace()
        self.tk.add_special_tokens(SPECIALS)
        self.n_vocab, self.eos_id = self.tk.get_vocab_size(), vocab["<|im_end|>"]

    def encode_rendered(self, text):
        return self.tk.encode(text, add_special_tokens=False).ids

    encode_ordinary = encode_rendered


def _words(conversations):
    return [w for c in conversations for m in c for w in m["content"].split()] + ["user", "assistant", "system"]


def _folder(tmp_path, **config):
    (tmp_path / "tok").mkdir(exist_ok=True)
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "<|im_end|>", "special": True},
         "add_bos_token": False, **config}))
    return tmp_path / "tok"


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_template_renders_and_masks_as_transformers_does(tmp_path):
    from transformers import PreTrainedTokenizerFast

    tok = WordTokenizer(_words([CHAT]))
    template = read_chat_template(_folder(tmp_path))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.tk, bos_token="<s>", eos_token="<|im_end|>",
                                 chat_template=TEMPLATE)
    for messages in (CHAT, CHAT[1:3], CHAT[1:4]):
        for gen in (False, True):
            assert template.render(messages, gen) == hf.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=gen)
    want = hf.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    ids, trained = encode_conversation(CHAT, tok, template)
    assert ids == want["input_ids"] and trained == [bool(m) for m in want["assistant_masks"]]
    with pytest.raises(ValueError, match=r"x.jsonl:1: the chat template of .*tokenizer_config.json failed: "
                                         r"Conversations start with the user or the system"):
        encode_conversation(CHAT[2:], tok, template, "x.jsonl:1")


def test_template_sources_in_the_tokenizer_folder(tmp_path):
    assert read_chat_template(None) is None
    assert read_chat_template(_folder(tmp_path, chat_template=None)) is None  # e.g. GPT-2: the plain join
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": TEMPLATE}]
    t = read_chat_template(_folder(tmp_path, chat_template=named))
    assert t.text == TEMPLATE and t.special == {"bos_token": "<s>", "eos_token": "<|im_end|>"}
    (tmp_path / "tok" / "chat_template.jinja").write_text("{{ eos_token }}")  # transformers' newer place wins
    assert read_chat_template(tmp_path / "tok").render(CHAT) == "<|im_end|>"


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    """Like Qwen 3's, which drops earlier turns' reasoning: turn i's answer is not where rendering
    messages[:i + 1] put it, so the answer's tokens cannot be told apart."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[old]{% else %}"
        "{{ m['role'] }}: {{ m['content'] }} {% endif %}{% endfor %}")}))
    tok = WordTokenizer(_words([CHAT]) + ["[old]", ":"])
    with pytest.raises(ValueError, match=r"d.jsonl:3: the chat template of .* renders turn 2 differently once "
                                         r"later turns follow"):
        encode_conversation(CHAT, tok, read_chat_template(tmp_path / "tok"), "d.jsonl:3")


def test_plain_join_with_gpt2(tokenizer, tmp_path):
    path = _jsonl(tmp_path / "pr.jsonl", [{"prompt": "What is 2+2?", "response": "4"}, {"messages": CHAT}])
    data = open_data(path, tokenizer, 50257)
    assert isinstance(data, ExampleData) and [e.line for e in data.examples] == [1, 2]
    first = data.examples[0]
    assert tokenizer.decode(first.ids.tolist()) == "User: What is 2+2?\nAssistant: 4<|endoftext|>"
    assert tokenizer.decode(first.ids[first.trained].tolist()) == " 4<|endoftext|>"
    second = data.examples[1]
    assert tokenizer.decode(second.ids.tolist()) == ("System: be brief\nUser: hi there\nAssistant: fine thanks"
                                                     "<|endoftext|>User: how are you\nAssistant: ok<|endoftext|>")
    assert tokenizer.decode(second.ids[second.trained].tolist()) == " fine thanks<|endoftext|> ok<|endoftext|>"
    x, y = data.loader(seq=24, batch=2, seed=0, pack=False).take(torch.tensor([0, 1]))
    n = len(first.ids) - 1
    assert (x[0, n:] == tokenizer.eos_id).all() and (y[0, n:] == IGNORE_INDEX).all()  # padding: no loss
    for row, ex in enumerate((first, second)):  # each target is the next token where that token is an answer's
        k = min(len(ex.ids), 25) - 1
        assert torch.equal(x[row, :k], ex.ids[:k])
        assert torch.equal(y[row, :k], torch.where(ex.trained[1:k + 1], ex.ids[1:k + 1], IGNORE_INDEX))
    # a user's text that spells a special token stays text: it cannot end the answer early
    ids, _ = encode_conversation([{"role": "user", "content": "<|endoftext|>"},
                                  {"role": "assistant", "content": "no"}], tokenizer, None)
    assert ids.count(tokenizer.eos_id) == 1


def test_bad_lines_are_named(tokenizer, tmp_path):
    cases = [({"prompt": "a", "answer": "b"}, r"bad.jsonl:2: expected \{\"prompt\": str, \"response\": str\}"),
             ({"messages": [{"role": "user", "content": "a"}]}, r"bad.jsonl:2: no assistant message"),
             ({"messages": [{"role": "tool", "content": "a"}, {"role": "assistant", "content": "b"}]},
              r"bad.jsonl:2: role 'tool' \(the plain join knows system, user, assistant"),
             ({"messages": [{"role": "user", "content": ["a"]}]}, r"bad.jsonl:2: 'messages' must be a list")]
    for row, message in cases:
        path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "q", "response": "r"}, row])
        with pytest.raises(ValueError, match=message):
            open_data(path, tokenizer, 50257)


def test_loader_cuts_long_examples_loudly_and_refuses_ones_with_nothing_to_train(tokenizer, tmp_path):
    rows = [{"prompt": "short", "response": "yes"}] * 3 + [{"prompt": "p", "response": "word " * 40}]
    data = open_data(_jsonl(tmp_path / "d.jsonl", rows), tokenizer, 50257)
    line = data.loader(seq=16, batch=2, pack=False).describe()
    shortest, longest = len(data.examples[0].ids), len(data.examples[3].ids)
    assert line.startswith(f"4 examples of {shortest}-{longest} tokens")
    assert line.endswith(f"1 longer than --seq + 1 are cut, {longest - 17} answer tokens not trained "
                         f"(--seq {longest - 1} keeps all)")
    assert "cut" not in data.loader(seq=longest - 1, batch=2, pack=False).describe()
    rows = [{"prompt": "word " * 30, "response": "yes"}] * 3
    with pytest.raises(ValueError, match=r"3 examples have no answer token within --seq 16 \(lines 1, 2, 3\): raise "
                                         r"--seq"):
        open_data(_jsonl(tmp_path / "long.jsonl", rows), tokenizer, 50257).loader(seq=16, batch=2)
    train, held = data.split(0.25)
    assert [e.line for e in held.examples] == [4] and len(train.examples) == 3
    assert data.fingerprint() != train.fingerprint()


def test_prompt_tokens_get_no_gradient(tokenizer, tmp_path):
    """The loss of a padded batch (``models.loss`` on the tiny preset) equals the cross-entropy of the answer
    positions alone, computed from the full logits with a mask built from the examples, not from the targets;
    and so do the gradients: predicting a prompt or padding token contributes nothing.

    Both sides sum the same fp32 terms in other orders (chunked head against full logits): the softmax sums
    over 50257 logits and the weight gradients over 96 positions agree to ~log2(n) roundings (u = 6e-8),
    ~1e-6 relative (measured: loss equal, gradients 4e-7). One prompt or padding term let in moves the loss
    by percents (all positions counted: 10.54 against 10.89 here)."""
    cfg = models.preset("tiny")
    rows = [{"prompt": "Name a colour.", "response": "Blue, like the sea."},
            {"messages": CHAT}, {"prompt": "Count to three.", "response": "One two three"}]
    data = open_data(_jsonl(tmp_path / "c.jsonl", rows), tokenizer, cfg.vocab_size)
    x, y = data.loader(seq=32, batch=3, seed=0, pack=False).take(torch.arange(3))
    answer = torch.zeros_like(x, dtype=torch.bool)
    for row, ex in enumerate(data.examples):
        answer[row, :len(ex.ids) - 1] = ex.trained[1:]
    assert 0 < answer.sum() < (y != IGNORE_INDEX).numel() / 2
    params = models.init_params(cfg, seed=0)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    ours = models.loss(params, x, y, cfg)
    grads = torch.autograd.grad(ours, leaves)
    logits = models.logits(params, x, cfg)
    full_targets = torch.cat([x[:, 1:], x[:, :1]], dim=1)  # any ids: the mask must select the answers
    want = torch.nn.functional.cross_entropy(logits[answer], torch.where(answer, y, full_targets)[answer])
    # the same loss summed in other orders: the model's chain over the answers' tokens (conftest.chain_rtol)
    loss_rtol, grad_rtol = (chain_rtol(model_chain(cfg, 32, int(answer.sum()), what)) for what in ("loss", "grads"))
    assert ours.item() == pytest.approx(want.item(), rel=loss_rtol)
    for g, w in zip(grads, torch.autograd.grad(want, leaves)):
        assert (g - w).norm() <= grad_rtol * w.norm() + 1e-12  # 1e-12: a leaf whose gradient is zero on both sides
