"""The model seam: a family is a folder here, and engines see only its ``ModelSpec`` (``spec.py``;
docs/ARCHITECTURE.md). The functions below take any family's config (or its spec).
"""
from __future__ import annotations

from typing import Any

import torch

from nanotrain.core.models import run
from nanotrain.core.models.registry import FAMILIES, PRESETS, family_of, model_spec, preset
from nanotrain.core.models.spec import ModelSpec
from nanotrain.core.tree import Tree
def init_params(model: Any, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> Tree:
    """Fresh parameters of the family's init, from one seeded generator."""
    return run.init_params(model_spec(model), seed, dtype, device)


def loss(params: Tree, tokens: torch.Tensor, targets: torch.Tensor, model: Any, seed: int | None = None,
         denom: float | None = None, chunk_tokens: int = 2048) -> torch.Tensor:
    """Mean next-token cross-entropy; ``targets`` already shifted, -100 marks ignored positions."""
    return run.loss(model_spec(model), params, tokens, targets, seed, denom, chunk_tokens)


def logits(params: Tree, tokens: torch.Tensor, model: Any) -> torch.Tensor:
    return run.logits(model_spec(model), params, tokens)


def hidden_states(params: Tree, tokens: torch.Tensor, model: Any, seed: int | None = None) -> torch.Tensor:
    """embed -> blocks -> final norm."""
    return run.run_units(model_spec(model), params, tokens, seed=seed)


__all__ = ["FAMILIES", "ModelSpec", "PRESETS", "family_of", "hidden_states", "init_params", "logits",
           "loss", "model_spec", "preset", "run"]
