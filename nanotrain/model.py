"""GPT-2 as pure functions over a tree of plain tensors.

The tree is ``{"wte", "wpe", "blocks": [block, ...], "ln_f_w", "ln_f_b"}`` where each block is
a flat dict of twelve tensors. Linear weights are stored ``[out, in]`` (``F.linear``'s layout);
the LM head is the token embedding itself. Nothing here knows about devices, precision,
checkpointing or parallelism: those are applied from outside by moving, casting or slicing
tensors of this tree and by calling ``embed``/``block``/``head`` in whatever order they need.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.nn.functional as F

from nanotrain.models.gpt2 import GPT2Config
from nanotrain.linear import linear
from nanotrain.loss import chunked_cross_entropy, kept_logits_cross_entropy
from nanotrain.tree import Tree, set_path

Block = dict[str, torch.Tensor]

# Init kinds: "normal" (std 0.02), "residual" (std 0.02 / sqrt(2 * n_layer)), "zeros", "ones".
BLOCK_SPEC = (
    ("ln_1_w", lambda c: (c,), "ones"),
    ("ln_1_b", lambda c: (c,), "zeros"),
    ("qkv_w", lambda c: (3 * c, c), "normal"),
    ("qkv_b", lambda c: (3 * c,), "zeros"),
    ("proj_w", lambda c: (c, c), "residual"),
    ("proj_b", lambda c: (c,), "zeros"),
    ("ln_2_w", lambda c: (c,), "ones"),
    ("ln_2_b", lambda c: (c,), "zeros"),
    ("fc_w", lambda c: (4 * c, c), "normal"),
    ("fc_b", lambda c: (4 * c,), "zeros"),
    ("fc_proj_w", lambda c: (c, 4 * c), "residual"),
    ("fc_proj_b", lambda c: (c,), "zeros"),
)


def param_spec(cfg: GPT2Config) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """Every parameter as (dotted path, shape, init kind), in checkpoint order."""
    c = cfg.n_embd
    yield "wte", (cfg.vocab_size, c), "normal"
    yield "wpe", (cfg.n_ctx, c), "normal"
    for i in range(cfg.n_layer):
        for name, shape, kind in BLOCK_SPEC:
            yield f"blocks.{i}.{name}", shape(c), kind
    yield "ln_f_w", (c,), "ones"
    yield "ln_f_b", (c,), "zeros"


def init_tensor(shape: tuple[int, ...], kind: str, cfg: GPT2Config, generator: torch.Generator) -> torch.Tensor:
    """GPT-2's init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer); on the generator's device."""
    device = generator.device
    if kind == "ones":
        return torch.ones(shape, device=device)
    if kind == "zeros":
        return torch.zeros(shape, device=device)
    std = 0.02 if kind == "normal" else 0.02 / math.sqrt(2 * cfg.n_layer)
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


def empty_tree(cfg: GPT2Config) -> Tree:
    """The tree's skeleton (dicts and lists) with no tensors in it yet."""
    return {"wte": None, "wpe": None, "blocks": [{} for _ in range(cfg.n_layer)], "ln_f_w": None, "ln_f_b": None}


def init_stream(cfg: GPT2Config, seed: int = 0,
                device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Fresh fp32 parameters one at a time, in ``param_spec`` order, from one seeded generator.

    Streaming lets a random gpt2-xl checkpoint be written without holding the model in memory,
    and gives the same tensors as ``init_params`` with the same seed and device (the random
    streams of CPU and CUDA generators differ).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    for path, shape, kind in param_spec(cfg):
        yield path, init_tensor(shape, kind, cfg, gen)


def init_params(
    cfg: GPT2Config, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> Tree:
    params = empty_tree(cfg)
    for path, t in init_stream(cfg, seed, device):
        set_path(params, path, t.to(dtype=dtype))
    return params


def validate_tokens(tokens: torch.Tensor, cfg: GPT2Config, pos_offset: int = 0) -> None:
    """Reject inputs that would index past the embeddings (on GPU that is a device-side assert)."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens must be int64 or int32, got {tokens.dtype}")
    seq = tokens.shape[1] + pos_offset
    if seq > cfg.n_ctx:
        raise ValueError(f"sequence length {seq} exceeds the model's context of {cfg.n_ctx} tokens; "
                         f"truncate the input or use blocks of at most {cfg.n_ctx}")
    if tokens.numel():
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= cfg.vocab_size:
            bad = hi if hi >= cfg.vocab_size else lo
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size}); "
                             f"was the text encoded with a different tokenizer?")


# ---------------------------------------------------------------------------------------------
# Dropout whose masks are a pure function of a seed, so recomputation replays them exactly.


def dropout(x: torch.Tensor, p: float, gen: torch.Generator | None) -> torch.Tensor:
    """Inverted dropout whose mask comes from ``gen`` (None: no dropout, as in eval)."""
    if gen is None or p == 0.0:
        return x
    keep = torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32) >= p
    return x * keep.to(x.dtype) / (1.0 - p)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# The layers.


def embed(params: Tree, tokens: torch.Tensor, cfg: GPT2Config, seed: int | None = None,
          pos_offset: int = 0) -> torch.Tensor:
    """Token + position embeddings. ``seed`` turns dropout on (training) and fixes its mask."""
    pos = torch.arange(pos_offset, pos_offset + tokens.shape[1], device=tokens.device)
    x = F.embedding(tokens, params["wte"]) + F.embedding(pos, params["wpe"])
    return dropout(x, cfg.embd_pdrop, make_generator(seed, x.device))


def split_heads(qkv: torch.Tensor, cfg: GPT2Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, T, 3C] -> three [B, H, T, D] views (q, k, v); works for any number of local heads.

    Unbound before transposing: backward then stacks the three gradients straight into the
    ``[B, T, 3, H, D]`` layout of ``qkv`` in one copy. Transposing first made it stack them as
    ``[3, B, H, T, D]`` and copy once more to undo the permutation.
    """
    b, t, three_c = qkv.shape
    heads = three_c // (3 * cfg.head_dim)
    q, k, v = (part.transpose(1, 2) for part in qkv.view(b, t, 3, heads, cfg.head_dim).unbind(2))
    return q, k, v


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    b, h, t, d = y.shape
    return y.transpose(1, 2).reshape(b, t, h * d)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float,
                     gen: torch.Generator | None) -> torch.Tensor:
    """Causal softmax attention. With dropout it is written out so its mask comes from ``gen``."""
    if gen is None or p == 0.0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    att = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return dropout(att, p, gen) @ v


def qkv_heads(p: Block, x: torch.Tensor, cfg: GPT2Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ln_1 -> fused qkv projection -> q, k, v as [B, H, T, D]."""
    h = F.layer_norm(x, (x.shape[-1],), p["ln_1_w"], p["ln_1_b"], cfg.layer_norm_eps)
    return split_heads(linear(h, p["qkv_w"], p["qkv_b"]), cfg)


def attention(p: Block, x: torch.Tensor, cfg: GPT2Config, gen: torch.Generator | None = None) -> torch.Tensor:
    """ln_1 -> fused qkv -> causal attention -> output projection (without the residual add)."""
    q, k, v = qkv_heads(p, x, cfg)
    y = merge_heads(causal_attention(q, k, v, cfg.attn_pdrop, gen))
    return dropout(linear(y, p["proj_w"], p["proj_b"]), cfg.resid_pdrop, gen)


def mlp_hidden(p: Block, x: torch.Tensor, cfg: GPT2Config) -> torch.Tensor:
    """ln_2 -> up projection -> tanh GELU: the MLP's 4C-wide hidden activations."""
    h = F.layer_norm(x, (x.shape[-1],), p["ln_2_w"], p["ln_2_b"], cfg.layer_norm_eps)
    return F.gelu(linear(h, p["fc_w"], p["fc_b"]), approximate="tanh")


def mlp_out(p: Block, g: torch.Tensor, cfg: GPT2Config, gen: torch.Generator | None = None) -> torch.Tensor:
    """The MLP's down projection (and its dropout) of the hidden activations ``g``."""
    return dropout(linear(g, p["fc_proj_w"], p["fc_proj_b"]), cfg.resid_pdrop, gen)


def mlp(p: Block, x: torch.Tensor, cfg: GPT2Config, gen: torch.Generator | None = None) -> torch.Tensor:
    """ln_2 -> up projection -> tanh GELU -> down projection (without the residual add)."""
    return mlp_out(p, mlp_hidden(p, x, cfg), cfg, gen)


def sublayer_seeds(seed: int | None) -> tuple[int | None, int | None]:
    """Dropout seeds of a block's attention and MLP: separate, so either can be recomputed alone."""
    return (None, None) if seed is None else (2 * seed, 2 * seed + 1)


def block_trunk(p: Block, x: torch.Tensor, cfg: GPT2Config,
                seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The block short of its last matmul: (x plus the attention, the MLP's hidden activations).

    Backward of a recomputed block needs no more: the down projection's gradients come from its
    input and the output gradient alone (``checkpointing.block_grads``).
    """
    h = x + attention(p, x, cfg, make_generator(sublayer_seeds(seed)[0], x.device))
    return h, mlp_hidden(p, h, cfg)


def block(p: Block, x: torch.Tensor, cfg: GPT2Config, seed: int | None = None) -> torch.Tensor:
    """One transformer block. The same ``seed`` gives the same dropout masks on recompute."""
    h, g = block_trunk(p, x, cfg, seed)
    return h + mlp_out(p, g, cfg, make_generator(sublayer_seeds(seed)[1], x.device))


def final_norm(params: Tree, x: torch.Tensor, cfg: GPT2Config) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), params["ln_f_w"], params["ln_f_b"], cfg.layer_norm_eps)


def hidden_states(params: Tree, tokens: torch.Tensor, cfg: GPT2Config, seed: int | None = None) -> torch.Tensor:
    """embed -> blocks -> final LayerNorm. Block i uses dropout seed ``seed + 1 + i``."""
    x = embed(params, tokens, cfg, seed)
    for i, p in enumerate(params["blocks"]):
        x = block(p, x, cfg, None if seed is None else seed + 1 + i)
    return final_norm(params, x, cfg)


def logits(params: Tree, tokens: torch.Tensor, cfg: GPT2Config) -> torch.Tensor:
    """Full [B, T, vocab] logits (inference and tests; training uses ``loss``)."""
    validate_tokens(tokens, cfg)
    return F.linear(hidden_states(params, tokens, cfg), params["wte"])


def head_loss(params: Tree, h: torch.Tensor, targets: torch.Tensor, denom: int | None = None,
              chunk_tokens: int = 2048, keep_logits: bool = False) -> torch.Tensor:
    """Cross-entropy of the tied LM head on final hidden states, never materialising all logits.

    ``keep_logits``: keep them instead and compute the gradients in backward (a pipeline's last
    stage, see ``nanotrain.loss``); needs ``denom``.
    """
    h, w, targets = h.reshape(-1, h.shape[-1]), params["wte"], targets.reshape(-1)
    if keep_logits:
        return kept_logits_cross_entropy(h, w, targets, denom, chunk_tokens)
    return chunked_cross_entropy(h, w, targets, denom=denom, chunk_tokens=chunk_tokens)


def loss(params: Tree, tokens: torch.Tensor, targets: torch.Tensor, cfg: GPT2Config, seed: int | None = None,
         denom: int | None = None, chunk_tokens: int = 2048) -> torch.Tensor:
    """Mean next-token cross-entropy; ``targets`` are already shifted, -100 marks ignored positions."""
    validate_tokens(tokens, cfg)
    if targets.shape != tokens.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} != tokens shape {tuple(tokens.shape)}")
    return head_loss(params, hidden_states(params, tokens, cfg, seed), targets, denom, chunk_tokens)
