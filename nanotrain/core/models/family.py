"""``Family``: what a model family folder hands the registry, and its Hugging Face layout (``config.json``
both ways, each tensor's name). Loading and saving through that layout is generic (``weights/``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from nanotrain.core.models.spec import ModelSpec
@dataclass(frozen=True)
class HFName:
    """One leaf of ours and the Hugging Face tensor(s) it is: several are concatenated along dim 0 (a fused
    q/k/v or gate/up matrix); ``transpose``: HF stores it ``[in, out]`` (GPT-2's ``Conv1D``)."""
    ours: str
    hf: tuple[str, ...]
    transpose: bool = False


@dataclass(frozen=True)
class HFLayout:
    model_types: tuple[str, ...]                # config.json "model_type" values this family reads
    from_config: Callable[[dict], Any]          # config.json -> our config (ValueError naming what it cannot take)
    to_config: Callable[[Any], dict]            # our config -> a config.json that ``transformers`` loads
    top: Mapping[str, str]                      # a top-level leaf -> its HF tensor
    block: Mapping[str, tuple[str, ...]]        # a block's leaf -> its HF tensors, named within the layer
    layer_prefix: str                           # what precedes a layer's number in its tensors' names
    transposed: tuple[str, ...] = ()            # block leaves HF stores ``[in, out]`` (GPT-2's ``Conv1D``)
    ignored: tuple[str, ...] = ()               # suffixes of tensors that are buffers, not parameters
    optional_prefix: str = ""                   # a prefix some files carry on every name (GPT-2's "transformer.")
    tied_copy: str | None = None                # a tensor some files carry that must equal a tied leaf
    dropout_keys: tuple[str, ...] = ()          # the config.json keys of its dropout probabilities (0: off)

    def names(self, spec: ModelSpec) -> list[HFName]:
        """The name table of ``spec``'s leaves, in checkpoint order."""
        table = []
        for leaf in spec.leaves:
            *block, name = leaf.path.split(".")  # block: ["blocks", i], or [] for a top-level leaf
            known = self.block if block else self.top
            if name not in known:
                raise ValueError(f"{spec.family}'s Hugging Face name table has no {leaf.path}")
            hf = tuple(f"{self.layer_prefix}{block[1]}.{part}" for part in known[name]) if block else (known[name],)
            table.append(HFName(leaf.path, hf, name in self.transposed))
        return table


# Which tokenizer a family's presets use (``weights.resolve``): GPT-2's BPE through tiktoken, or the
# ``tokenizer.json`` of the preset's hub repository, fetched with its ``config.json``.
GPT2_BPE, HUB_TOKENIZER_JSON = "gpt2-bpe", "hub-tokenizer.json"


@dataclass(frozen=True)
class Family:
    name: str
    config: type
    presets: Mapping[str, Any]
    spec: Callable[[Any], ModelSpec]
    hf: HFLayout
    hub_ids: Mapping[str, str]                  # preset -> the hub repository of its pretrained weights
    tokenizer: str = HUB_TOKENIZER_JSON         # GPT2_BPE or HUB_TOKENIZER_JSON
