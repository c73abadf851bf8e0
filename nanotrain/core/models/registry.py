"""Names to models: every family, its presets, and the spec of any config.

``--model`` takes a preset (``gpt2-large``, ``llama-3.2-1b``), a local folder in the Hugging Face layout or a
hub id (``weights.hub``); this room knows the families and their presets, and turns a config into its spec.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from nanotrain.core.models import gpt2, llama
from nanotrain.core.models.family import Family
from nanotrain.core.models.spec import ModelSpec
FAMILIES: dict[str, Family] = {f.name: f for f in (gpt2.FAMILY, llama.FAMILY)}
PRESETS: dict[str, Any] = {name: cfg for f in FAMILIES.values() for name, cfg in f.presets.items()}


def preset(name: str, **overrides: Any) -> Any:
    """A preset's config (with ``overrides`` of its fields); the error names the presets there are."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(PRESETS)})")
    return replace(PRESETS[name], **overrides)


def family_of(cfg: Any) -> Family:
    for family in FAMILIES.values():
        if isinstance(cfg, family.config):
            return family
    raise TypeError(f"{type(cfg).__name__} is no model family's config (families: {', '.join(FAMILIES)})")


def family_for_model_type(model_type: str) -> Family:
    """The family that reads a ``config.json`` of this ``model_type``."""
    for family in FAMILIES.values():
        if model_type in family.hf.model_types:
            return family
    known = sorted(t for f in FAMILIES.values() for t in f.hf.model_types)
    raise ValueError(f"config.json's model_type {model_type!r} is not one nanotrain trains (known: {', '.join(known)})")


def model_spec(model: Any) -> ModelSpec:
    """The spec of a config of any family (a spec is returned as it is)."""
    if isinstance(model, ModelSpec):
        return model
    return family_of(model).spec(model)
