"""What ``--model`` names: a preset (``gpt2-large``), a local folder in the Hugging Face layout, or a hub id
(``meta-llama/Llama-3.2-1B``). A folder's ``config.json`` picks the family by its ``model_type`` and gives the
config; a hub id is a folder fetched (its config and tokenizer files; the weights when they are loaded).

Its tokenizer is the family's (``Family.tokenizer``): GPT-2's BPE, or a ``tokenizer.json``: the folder's, or for a
preset its hub repository's, fetched (with its config.json) only when a run asks for it, so a run on token files
needs neither the network nor a tokenizer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanotrain.models import PRESETS, preset
from nanotrain.models.family import GPT2_BPE
from nanotrain.models.registry import family_for_model_type, family_of
from weights.hub import fetch_model, fetch_tokenizer, is_hub_id
from weights.safetensors_io import CheckpointError


@dataclass(frozen=True)
class ResolvedModel:
    name: str                   # as --model gave it
    cfg: Any
    folder: Path | None         # its Hugging Face folder: the one given, or the hub's copy of its config/tokenizer
    hub_id: str | None          # the hub repository given as --model

    def weights(self, given: str) -> str:
        """``--weights`` as ``load_weights`` takes it: ``hub``, the model's own pretrained weights, is the hub
        id's or the folder's (a preset's hub repository is found from its config)."""
        if given != "hub":
            return given
        return self.hub_id or (str(self.folder) if self.folder is not None else given)

    def tokenizer_folder(self) -> Path | None:
        """The folder of the model's own ``tokenizer.json``: its folder's, else for a preset whose family uses one,
        its hub repository's (the HF cache's copy, or fetched). None: the family's tokenizer is GPT-2's BPE. A
        ``tokenizer.json`` that cannot be had is one line (CheckpointError) naming ``--tokenizer-dir``."""
        if self.folder is not None and (self.folder / "tokenizer.json").is_file():
            return self.folder
        family = family_of(self.cfg)
        if family.tokenizer == GPT2_BPE:
            return None
        fix = ("pass --tokenizer-dir DIR (a folder with its tokenizer.json), or --data a .bin/.npy token file, which "
               "needs no tokenizer")
        if self.folder is None and self.name in family.hub_ids:
            return fetch_tokenizer(family.hub_ids[self.name], fix)
        where = f"its folder {self.folder} has none" if self.folder is not None else "it has no hub repository"
        raise CheckpointError(f"{self.name} ({family.name}) reads text with its own tokenizer.json, and {where}; {fix}")


def read_config(folder: str | Path) -> Any:
    """Our config from a Hugging Face folder's ``config.json``, of the family its ``model_type`` names."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a model folder in the Hugging Face layout")
    try:
        hf = json.loads(path.read_text())
        family = family_for_model_type(hf.get("model_type"))
        return family.hf.from_config(hf)
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: {e}") from e
    except KeyError as e:
        raise CheckpointError(f"{path} lacks the field {e.args[0]!r}") from e


def resolve_model(name: str) -> ResolvedModel:
    """A preset, a folder or a hub id; errors are one line, raised before any weights are read."""
    if name in PRESETS:
        return ResolvedModel(name, preset(name), None, None)
    if Path(name).exists():
        return ResolvedModel(name, read_config(name), Path(name), None)
    if is_hub_id(name):
        folder = fetch_model(name)
        return ResolvedModel(name, read_config(folder), folder, name)
    raise CheckpointError(f"unknown model {name!r}: not a preset (known: {', '.join(PRESETS)}), a folder with a "
                          f"config.json, or a hub id such as meta-llama/Llama-3.2-1B")
