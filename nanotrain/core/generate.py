"""Sampling with a key/value cache: the family's own forward (``models.run.run_units``, ``run.block``), each
block run with a ``models.cache.CacheOps`` that holds its keys and values."""
from __future__ import annotations

from typing import Any

import torch

from nanotrain.core.models import model_spec
from nanotrain.core.models.cache import CacheOps, empty_caches
from nanotrain.core.models.ops import PLAIN
from nanotrain.core.models.run import block, run_units, validate_tokens
from nanotrain.core.tree import Tree, get_path


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator | None) -> torch.Tensor:
    if temperature == 0.0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)


@torch.no_grad()
def generate(params: Tree, prompt_ids: torch.Tensor, model: Any, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Extend ``prompt_ids`` [B, T] by ``max_new_tokens``; temperature 0 is greedy. Returns [B, T + new].

    ``model``: any family's config, or its spec.
    """
    spec = model_spec(model)
    validate_tokens(spec, prompt_ids)
    b, t0 = prompt_ids.shape
    if t0 == 0:
        raise ValueError("the prompt is empty: give at least one token (e.g. the tokenizer's BOS or EOS)")
    total = t0 + max_new_tokens
    if total > spec.n_ctx:
        raise ValueError(f"prompt ({t0}) + max_new_tokens ({max_new_tokens}) = {total} exceeds the {spec.longest}; "
                         f"shorten the prompt or ask for fewer tokens")
    head = get_path(params, spec.head_weight)
    caches = empty_caches(spec, b, total, head)
    out, step_ids, pos = prompt_ids, prompt_ids, 0
    for _ in range(max_new_tokens):
        # The step's tokens sit at positions pos ..; each block's keys and values join its cache.
        h = run_units(spec, params, step_ids, ops=CacheOps(pos),
                      block_fn=lambda p, x, seed, i, _: block(spec, p, x, CacheOps(pos, caches[i]), seed))
        pos += step_ids.shape[1]
        step_ids = _sample(PLAIN.logits(h[:, -1], head), temperature, top_k, generator)
        out = torch.cat([out, step_ids], dim=1)
    return out
