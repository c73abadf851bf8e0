"""The forward pass of any ``ModelSpec``: the block composed from the family's pieces, and ``run_units``,
the one place the order embed -> blocks -> head is written.

Every function here is pure in ``(params, inputs, seed)`` and takes the ``Ops`` set to compute with, so
recompute is "call again", streaming and sharding are "move or slice the leaves first", and an engine
changes how a unit runs through the ``run`` and ``block_fn`` hooks of ``run_units``, never the order.
Dropout: the embedding uses the step's ``seed``, block ``i`` uses ``seed + 1 + i`` (``block_seed``),
its attention and MLP separate generators from that (``generators``).
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from nanotrain.core.loss import validate_targets
from nanotrain.core.models.documents import check_positions
from nanotrain.core.models.lora import LORA_A_INIT, carry
from nanotrain.core.models.ops import PLAIN, PlainOps, make_generator
from nanotrain.core.models.spec import ModelSpec, Unit
from nanotrain.core.tree import Tree, set_path

# (params, x, seed, index, ops) -> x; ``ops`` are ``run_units``' own, carrying a packed micro-batch's documents
BlockFn = Callable[[dict, torch.Tensor, "int | None", int, PlainOps], torch.Tensor]


def block_seed(seed: int | None, index: int) -> int | None:
    return None if seed is None else seed + 1 + index


def generators(seed: int | None, device: torch.device) -> tuple[torch.Generator | None, torch.Generator | None]:
    """The attention's and the MLP's dropout generators of a block run with ``seed``: separate, so either
    sublayer can be recomputed alone."""
    if seed is None:
        return None, None
    return make_generator(2 * seed, device), make_generator(2 * seed + 1, device)


def attention_residual(spec: ModelSpec, p: dict, x: torch.Tensor, ops: PlainOps,
                       gen: torch.Generator | None) -> torch.Tensor:
    """``x`` plus the attention sublayer's output (dropped out)."""
    return x + ops.dropout(spec.attention(carry(spec, p, gen), x, ops, gen), spec.dropout.residual, gen)


def mlp(spec: ModelSpec, p: dict, h: torch.Tensor, ops: PlainOps = PLAIN,
        gen: torch.Generator | None = None) -> torch.Tensor:
    """The MLP sublayer's output (dropped out, without the residual add)."""
    w, b = spec.mlp_out
    p = carry(spec, p, gen)
    u = spec.mlp_in(p, h, ops)
    return ops.dropout(ops.act_row(u, spec.act, p[w], p[b] if b else None), spec.dropout.residual, gen)


def trunk(spec: ModelSpec, p: dict, x: torch.Tensor, ops: PlainOps = PLAIN,
          seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The block short of its activation and last matmul: (``x`` plus the attention, the MLP's ``u``).

    A recomputed block's backward needs no more (``core.recompute.block_grads``): the last matmul's
    gradients come from its input and the output gradient alone.
    """
    gen_attn, gen_mlp = generators(seed, x.device)
    h = attention_residual(spec, p, x, ops, gen_attn)
    return h, spec.mlp_in(carry(spec, p, gen_mlp), h, ops)


def block(spec: ModelSpec, p: dict, x: torch.Tensor, ops: PlainOps = PLAIN, seed: int | None = None,
          gens: tuple | None = None) -> torch.Tensor:
    """One block. The same ``seed`` gives the same dropout masks on recompute. ``gens``: the attention's and
    the MLP's mask sources instead of the seed's generators (masks an op set drew already, outside a graph)."""
    gen_attn, gen_mlp = gens or generators(seed, x.device)
    h = attention_residual(spec, p, x, ops, gen_attn)
    return h + mlp(spec, p, h, ops, gen_mlp)


def head_loss(spec: ModelSpec, params: Tree, x: torch.Tensor, targets: torch.Tensor, ops: PlainOps = PLAIN,
              denom: float | None = None, chunk_tokens: int = 2048, keep_logits: bool = False) -> torch.Tensor:
    """The final norm and the output matrix's cross-entropy, never materialising all logits."""
    return ops.head_loss(spec.final_norm(params, x), params[spec.head_weight], targets, denom, chunk_tokens,
                         keep_logits)


def run_units(spec: ModelSpec, params: Tree, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
              ops: PlainOps = PLAIN, seed: int | None = None, denom: float | None = None, chunk_tokens: int = 2048,
              block_fn: BlockFn | None = None,
              run: Callable[[Unit, Callable, torch.Tensor | None], torch.Tensor] | None = None,
              positions: torch.Tensor | None = None) -> torch.Tensor:
    """embed -> each block -> head: the loss over ``targets``, or without them the final hidden states.

    ``block_fn(p, x, seed, index, ops)`` runs a block (default ``block`` with ``ops``: a recompute policy or a
    compiled block goes here). ``run(unit, fn, x)`` computes a unit as ``fn(tree, x)``: an engine's hook to
    bring the unit's weights first, or to gather and recompute it; by default ``fn(params, x)``.
    ``positions``: packed rows' positions in their documents (``models.documents``), on the tokens' device.
    """
    run = run or (lambda unit, fn, x: fn(params, x))
    ops = ops.packed(positions)
    step = block_fn or (lambda p, x, s, i, o: block(spec, p, x, o, s))
    x = run(spec.embed_unit, lambda tree, _: spec.embed(tree, tokens, ops, seed), None)
    for unit in spec.block_units:
        x = run(unit, lambda tree, x, i=unit.index: step(tree["blocks"][i], x, block_seed(seed, i), i, ops), x)
    if targets is None:
        return run(spec.head_unit, lambda tree, x: spec.final_norm(tree, x), x)
    return run(spec.head_unit, lambda tree, x: head_loss(spec, tree, x, targets, ops, denom, chunk_tokens), x)


def validate_tokens(spec: ModelSpec, tokens: torch.Tensor) -> None:
    """Reject inputs that would index past the embeddings (on a GPU that is a device-side assert)."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens must be int64 or int32, got {tokens.dtype}")
    seq = tokens.shape[1]
    if seq > spec.n_ctx:
        raise ValueError(f"sequence length {seq} exceeds the model's {spec.longest}; "
                         f"truncate the input or use blocks of at most {spec.n_ctx}")
    if tokens.numel():
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= spec.vocab_size:
            bad = hi if hi >= spec.vocab_size else lo
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {spec.vocab_size}); "
                             f"was the text encoded with a different tokenizer?")


def loss(spec: ModelSpec, params: Tree, tokens: torch.Tensor, targets: torch.Tensor, seed: int | None = None,
         denom: float | None = None, chunk_tokens: int = 2048, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy; ``targets`` are already shifted, -100 marks ignored positions; ``positions``:
    packed rows' (``models.documents``)."""
    validate_tokens(spec, tokens)
    if targets.shape != tokens.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} != tokens shape {tuple(tokens.shape)}")
    validate_targets(targets, spec.vocab_size)
    if positions is not None:
        check_positions(positions, tokens)
    return run_units(spec, params, tokens, targets, seed=seed, denom=denom, chunk_tokens=chunk_tokens,
                     positions=positions)


def logits(spec: ModelSpec, params: Tree, tokens: torch.Tensor) -> torch.Tensor:
    """Full ``[B, T, vocab]`` logits (inference and tests; training uses ``loss``)."""
    validate_tokens(spec, tokens)
    return PLAIN.logits(run_units(spec, params, tokens), params[spec.head_weight])


# -- parameters ----------------------------------------------------------------------------------


def empty_tree(spec: ModelSpec) -> Tree:
    """The tree's skeleton (dicts and lists, top-level leaves first) with no tensors in it yet."""
    tree: dict = {}
    for leaf in spec.leaves:
        head, _, rest = leaf.path.partition(".")
        if head != "blocks":
            tree[head] = None
        elif "blocks" not in tree:
            tree["blocks"] = [{} for _ in range(spec.n_layer)]
    return tree


def tree_from(spec: ModelSpec, leaves: Iterable[tuple[str, torch.Tensor]]) -> Tree:
    """The parameter tree holding ``leaves``, given as (dotted path, tensor)."""
    tree = empty_tree(spec)
    for path, t in leaves:
        set_path(tree, path, t)
    return tree


def init_stream(spec: ModelSpec, seed: int = 0, device: torch.device | str = "cpu",
                trainable_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Fresh fp32 parameters one at a time, in checkpoint order, from one seeded generator: a random
    checkpoint of any size is written without holding the model (the CPU's and CUDA's streams differ).
    ``trainable_only``: only the leaves that train (fresh adapters on a loaded base)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for leaf in (leaf for leaf in spec.leaves if leaf.trainable or not trainable_only):
        if leaf.init in ("ones", "zeros"):
            yield leaf.path, torch.full(leaf.shape, float(leaf.init == "ones"), device=gen.device)
        elif leaf.init == LORA_A_INIT:  # kaiming-uniform with a = sqrt(5): the bound is 1/sqrt(fan in)
            bound = leaf.shape[1] ** -0.5
            yield leaf.path, torch.empty(leaf.shape, device=gen.device).uniform_(-bound, bound, generator=gen)
        else:
            std = spec.init_std[leaf.init]
            yield leaf.path, torch.empty(leaf.shape, device=gen.device).normal_(0.0, std, generator=gen)


def init_params(spec: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> Tree:
    return tree_from(spec, ((path, t.to(dtype=dtype)) for path, t in init_stream(spec, seed, device)))
