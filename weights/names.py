"""The explicit name table between our parameter tree and Hugging Face's GPT-2 checkpoints.

HF's GPT-2 uses ``Conv1D`` layers whose weights are stored ``[in, out]``; ours are ``[out, in]``
(``F.linear``), so those four matrices per block are transposed on the way in and out.
"""
from __future__ import annotations

from dataclasses import dataclass

from nanotrain.models.gpt2 import GPT2Config
from nanotrain.model import param_spec

PREFIX = "transformer."

_BLOCK_NAMES = {
    "ln_1_w": ("ln_1.weight", False),
    "ln_1_b": ("ln_1.bias", False),
    "qkv_w": ("attn.c_attn.weight", True),
    "qkv_b": ("attn.c_attn.bias", False),
    "proj_w": ("attn.c_proj.weight", True),
    "proj_b": ("attn.c_proj.bias", False),
    "ln_2_w": ("ln_2.weight", False),
    "ln_2_b": ("ln_2.bias", False),
    "fc_w": ("mlp.c_fc.weight", True),
    "fc_b": ("mlp.c_fc.bias", False),
    "fc_proj_w": ("mlp.c_proj.weight", True),
    "fc_proj_b": ("mlp.c_proj.bias", False),
}
_TOP_NAMES = {"wte": "wte.weight", "wpe": "wpe.weight", "ln_f_w": "ln_f.weight", "ln_f_b": "ln_f.bias"}

# Buffers some checkpoints carry (the causal mask of old transformers versions): not parameters.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
TIED_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class Entry:
    ours: str               # dotted path in our tree, e.g. "blocks.3.qkv_w"
    hf: str                 # HF name without the "transformer." prefix, e.g. "h.3.attn.c_attn.weight"
    shape: tuple[int, ...]  # our shape
    transpose: bool         # HF stores it [in, out]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape)) if self.transpose else self.shape


def name_table(cfg: GPT2Config) -> list[Entry]:
    table = []
    for path, shape, _ in param_spec(cfg):
        parts = path.split(".")
        if parts[0] == "blocks":
            hf, transpose = _BLOCK_NAMES[parts[2]]
            table.append(Entry(path, f"h.{parts[1]}.{hf}", shape, transpose))
        else:
            table.append(Entry(path, _TOP_NAMES[path], shape, False))
    return table


def is_ignored(hf_name: str) -> bool:
    return hf_name.endswith(IGNORED_SUFFIXES)
