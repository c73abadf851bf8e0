"""What ``--model`` names: a preset (``gpt2-large``), a local folder in the Hugging Face layout, or a hub id
(``meta-llama/Llama-3.2-1B``). A folder's ``config.json`` picks the family by its ``model_type`` and gives the
config; a hub id is a folder fetched (its config and tokenizer files; the weights when they are loaded).

Its tokenizer is the family's (``Family.tokenizer``): GPT-2's BPE, or a ``tokenizer.json``: the folder's, or for a
preset its hub repository's, fetched (with its config.json) only when a run reads text, so a run on token files
needs neither the network nor a tokenizer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanotrain.core.models import PRESETS, preset
from nanotrain.core.models.family import GPT2_BPE
from nanotrain.core.models.registry import family_for_model_type, family_of
from weights.hub import MODEL, cached, has_tokenizer, is_hub_id, snapshot
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
        """The folder of the model's own ``tokenizer.json`` when one is at hand: its folder's, or for a preset its hub
        repository's in the Hugging Face cache (no network). None: none at hand, or the family reads GPT-2's BPE."""
        if self.folder is not None and has_tokenizer(self.folder):
            return self.folder
        repo = self._tokenizer_repo()
        return None if repo is None else cached(repo, MODEL, has_tokenizer)

    def fetch_tokenizer_folder(self) -> Path | None:
        """``tokenizer_folder``, a preset's fetched from the hub (with its config.json) when not cached. None: the
        family reads text with GPT-2's BPE. A ``tokenizer.json`` that cannot be had is one line (CheckpointError)
        naming ``--tokenizer-dir``."""
        family, at_hand = family_of(self.cfg), self.tokenizer_folder()
        if at_hand is not None or family.tokenizer == GPT2_BPE:
            return at_hand
        fix = ("pass --tokenizer-dir DIR (a folder with its tokenizer.json), or --data a .bin/.npy token file, which "
               "needs no tokenizer")
        repo = self._tokenizer_repo()
        if repo is not None:
            return snapshot(repo, MODEL, has_tokenizer, fix)
        where = f"its folder {self.folder} has none" if self.folder is not None else "it has no hub repository"
        raise CheckpointError(f"{self.name} ({family.name}) reads text with its own tokenizer.json, and {where}; {fix}")

    def _tokenizer_repo(self) -> str | None:
        """The hub repository of a preset whose family reads text with a ``tokenizer.json``."""
        family = family_of(self.cfg)
        if self.folder is None and family.tokenizer != GPT2_BPE:
            return family.hub_ids.get(self.name)
        return None


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
        folder = snapshot(name, MODEL, lambda f: (f / "config.json").is_file(),
                          "pass its folder: --model /path/to/folder")
        return ResolvedModel(name, read_config(folder), folder, name)
    raise CheckpointError(f"unknown model {name!r}: not a preset (known: {', '.join(PRESETS)}), a folder with a "
                          f"config.json, or a hub id such as meta-llama/Llama-3.2-1B")
