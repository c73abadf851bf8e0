"""Sampling with a key/value cache, built from the model's own attention pieces."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanotrain.models.gpt2 import GPT2Config
from nanotrain.model import embed, final_norm, merge_heads, mlp, qkv_heads, validate_tokens
from nanotrain.tree import Tree


def _cached_block(p: dict, x: torch.Tensor, cfg: GPT2Config, cache_k: torch.Tensor, cache_v: torch.Tensor,
                  pos: int) -> torch.Tensor:
    """``model.block`` for tokens at positions [pos, pos + T), attending to the cache before them."""
    t = x.shape[1]
    q, k, v = qkv_heads(p, x, cfg)
    cache_k[:, :, pos:pos + t] = k
    cache_v[:, :, pos:pos + t] = v
    keys, values = cache_k[:, :, :pos + t], cache_v[:, :, :pos + t]
    # Query i sits at absolute position pos + i and may see keys 0..pos + i.
    mask = torch.ones(t, pos + t, dtype=torch.bool, device=x.device).tril(diagonal=pos)
    y = merge_heads(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask))
    x = x + F.linear(y, p["proj_w"], p["proj_b"])
    return x + mlp(p, x, cfg)


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator | None) -> torch.Tensor:
    if temperature == 0.0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)


@torch.no_grad()
def generate(params: Tree, prompt_ids: torch.Tensor, cfg: GPT2Config, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Extend ``prompt_ids`` [B, T] by ``max_new_tokens``; temperature 0 is greedy. Returns [B, T + new]."""
    validate_tokens(prompt_ids, cfg)
    b, t0 = prompt_ids.shape
    if t0 == 0:
        raise ValueError("the prompt is empty: give at least one token (e.g. the end-of-text token 50256)")
    total = t0 + max_new_tokens
    if total > cfg.n_ctx:
        raise ValueError(f"prompt ({t0}) + max_new_tokens ({max_new_tokens}) = {total} exceeds the context of "
                         f"{cfg.n_ctx} tokens; shorten the prompt or ask for fewer tokens")
    wte = params["wte"]
    shape = (b, cfg.n_head, total, cfg.head_dim)
    caches = [(wte.new_empty(shape), wte.new_empty(shape)) for _ in params["blocks"]]
    out, step_ids, pos = prompt_ids, prompt_ids, 0
    for _ in range(max_new_tokens):
        x = embed(params, step_ids, cfg, pos_offset=pos)
        for p, (ck, cv) in zip(params["blocks"], caches):
            x = _cached_block(p, x, cfg, ck, cv, pos)
        last = F.linear(final_norm(params, x[:, -1], cfg), wte)
        pos += step_ids.shape[1]
        step_ids = _sample(last, temperature, top_k, generator)
        out = torch.cat([out, step_ids], dim=1)
    return out
