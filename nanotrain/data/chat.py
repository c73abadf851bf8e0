"""Instruction data: JSONL of ``{"prompt": ..., "response": ...}`` or ``{"messages": [{"role": ..., "content":
...}, ...]}``, rendered to token ids with the tokens to train on marked (the assistant's, nothing else).

With a chat template in the tokenizer folder (``chat_template.jinja``, or ``tokenizer_config.json``'s
``chat_template``), a conversation is rendered as ``transformers``' ``apply_chat_template`` renders it
(jinja2, the same sandbox settings and globals). The assistant's tokens are found by rendering
prefixes: the text between ``render(messages[:i], add_generation_prompt=True)`` and
``render(messages[:i + 1])`` is turn ``i``'s answer with the template's end-of-turn marker. Each span
is encoded on its own, as inference encodes the prompt and then generates: the ids are those of
``apply_chat_template(tokenize=True)`` wherever a span boundary is also a token boundary (template
markers are special tokens, so in practice everywhere).

Without a template, the plain join (prompt/response is one user turn and one assistant turn)::

    System: {system}\\n                         (not trained)
    User: {user}\\n                             (not trained)
    Assistant:                                  (not trained)
     {assistant}<end of text>                   (trained: the answer and the stop)

turns following one another directly; at inference, prompt with ``...Assistant:`` and stop at end of text.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import torch
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nanotrain.data.text import read_jsonl
from nanotrain.tokenizer import Tokenizer, end_of_text

PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class Example:
    """One conversation's ids and, per id, whether the model is trained to predict it."""
    ids: torch.Tensor      # int64 [n]
    trained: torch.Tensor  # bool [n]
    line: int              # in the JSONL file, for messages


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}`` marks the assistant's text for ``transformers``' mask;
    here the assistant's spans come from rendering prefixes, so the tag renders its body and no more."""
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer folder's chat template and the special-token strings it is rendered with."""
    text: str
    special: dict[str, str]  # bos_token, eos_token, ... as tokenizer_config.json names them
    origin: Path

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return _compile(self.text).render(messages=messages, tools=None, documents=None,
                                          add_generation_prompt=add_generation_prompt, **self.special)


@functools.lru_cache(maxsize=4)
def _compile(text: str) -> jinja2.Template:
    """The template as ``transformers`` compiles it: sandboxed, trim_blocks and lstrip_blocks, loop
    controls, the ``generation`` tag, its ``tojson`` (no HTML escaping), ``raise_exception``, ``strftime_now``."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(text)


def read_chat_template(tokenizer_dir: str | Path | None) -> ChatTemplate | None:
    """The folder's chat template (``chat_template.jinja`` first, as ``transformers`` saves it now), or None."""
    if tokenizer_dir is None:
        return None
    folder = Path(tokenizer_dir)
    config_file, jinja_file = folder / "tokenizer_config.json", folder / "chat_template.jinja"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    text, origin = config.get("chat_template"), config_file
    if jinja_file.is_file():
        text, origin = jinja_file.read_text(encoding="utf-8"), jinja_file
    if isinstance(text, list):  # named templates: the default one
        text = {t.get("name"): t.get("template") for t in text}.get("default")
    if not text:
        return None
    special = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items() if k in SPECIAL_TOKENS}
    return ChatTemplate(text, {k: v for k, v in special.items() if isinstance(v, str)}, origin)


def is_instruction_file(path: Path) -> bool:
    """A ``.jsonl`` file whose first object has ``messages`` or ``prompt``."""
    if path.suffix != ".jsonl":
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        obj = json.loads(first)
    except json.JSONDecodeError:
        return False  # read_documents names the line
    return isinstance(obj, dict) and ("messages" in obj or "prompt" in obj)


def conversation(obj: object, where: str) -> list[dict]:
    """The messages of one JSONL object, checked."""
    if isinstance(obj, dict) and "messages" in obj:
        messages = obj["messages"]
    elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and isinstance(obj.get("response"), str):
        messages = [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["response"]}]
    else:
        raise ValueError(f"{where}: expected {{\"prompt\": str, \"response\": str}} or {{\"messages\": [{{\"role\": "
                         f"..., \"content\": ...}}, ...]}}, as the file's first line")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in messages):
        raise ValueError(f"{where}: 'messages' must be a list of {{\"role\": str, \"content\": str}}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message, so nothing to train on")
    return messages


def _plain_spans(messages: list[dict], tok: Tokenizer, where: str) -> list[tuple[list[int], bool]]:
    spans = []
    for m in messages:
        if m["role"] not in PLAIN_ROLES:
            raise ValueError(f"{where}: role {m['role']!r} (the plain join knows {', '.join(PLAIN_ROLES)}; a "
                             f"tokenizer folder with a chat template renders others)")
        if m["role"] == "assistant":
            spans += [(tok.encode_ordinary("Assistant:"), False),
                      (tok.encode_ordinary(" " + m["content"]) + end_of_text(tok), True)]
        else:
            spans.append((tok.encode_ordinary(f"{PLAIN_ROLES[m['role']]}: {m['content']}\n"), False))
    return spans


def _template_spans(messages: list[dict], tok: Tokenizer, template: ChatTemplate,
                    where: str) -> list[tuple[list[int], bool]]:
    try:
        full = template.render(messages)
        cuts = []  # (start, end) of each assistant turn in the full text
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                prompt = template.render(messages[:i], add_generation_prompt=True)
                upto = template.render(messages[:i + 1])
                if not (full.startswith(prompt) and full.startswith(upto) and len(prompt) <= len(upto)
                        and (not cuts or cuts[-1][1] <= len(prompt))):
                    raise ValueError(f"{where}: the chat template of {template.origin} renders turn {i} differently "
                                     f"once later turns follow, so its answer's tokens cannot be found; give the "
                                     f"conversation as separate examples, one per assistant turn")
                cuts.append((len(prompt), len(upto)))
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"{where}: the chat template of {template.origin} failed: {e}") from e
    spans, done = [], 0
    for start, end in cuts:
        spans += [(tok.encode_rendered(full[done:start]), False), (tok.encode_rendered(full[start:end]), True)]
        done = end
    return spans + [(tok.encode_rendered(full[done:]), False)]


def encode_conversation(messages: list[dict], tok: Tokenizer, template: ChatTemplate | None,
                        where: str = "conversation") -> tuple[list[int], list[bool]]:
    """The conversation's ids and, per id, whether it is the assistant's (trained) or not."""
    spans = (_template_spans(messages, tok, template, where) if template is not None
             else _plain_spans(messages, tok, where))
    ids = [i for span, _ in spans for i in span]
    trained = [t for span, t in spans for _ in span]
    return ids, trained


def read_examples(path: Path, tok: Tokenizer, template: ChatTemplate | None) -> list[Example]:
    """Every line of an instruction JSONL file, encoded (refused at the first bad line, which it names)."""
    examples = []
    for n, obj in read_jsonl(path):
        where = f"{path}:{n}"
        ids, trained = encode_conversation(conversation(obj, where), tok, template, where)
        examples.append(Example(torch.tensor(ids, dtype=torch.int64), torch.tensor(trained), n))
    if not examples:
        raise ValueError(f"{path} holds no examples")
    return examples
