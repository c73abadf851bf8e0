"""``ModelSpec``: what an engine may know of a model, as data and pure functions.

A model family (a folder under ``nanotrain/core/models/``) builds one per config. Engines and planners read
only this and never name a family's leaves: a new family is a new folder, not edits across the engines.

The parameter tree is ``{top-level leaves..., "blocks": [{leaf: tensor}, ...]}``; a leaf's path is
a top-level name or ``"blocks.3.<name>"``. The units are the embedding (first), each block, and the head
(last: the final norm and, when untied, the output matrix), in forward order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Mapping, Sequence

import torch

from nanotrain.core.tree import Tree
# Tensor-parallel axes a placement can split over (``tensor_parallel.shard`` gives each rank its ranges):
# the attention's query heads, its key/value heads, the MLP's hidden neurons, the (padded) vocabulary.
Q_HEADS, KV_HEADS, NEURONS, VOCAB = "q_heads", "kv_heads", "neurons", "vocab"


@dataclass(frozen=True)
class Placement:
    """How tensor parallelism cuts a leaf: along ``dim`` (None: every rank holds it whole), as the
    concatenation of ``segments``, each ``(axis, rows)``: ``rows`` consecutive rows per element of
    ``axis`` (a head is ``head_dim`` rows). A fused q/k/v matrix is three segments, each split alike."""
    dim: int | None = None
    segments: tuple[tuple[str, int], ...] = ()
    in_region: bool = False  # held whole but applied inside a parallel region (per-head q/k norms): its
    #                          gradient is partial on every rank, with or without sequence parallelism

    @property
    def replicated(self) -> bool:
        return self.dim is None


REPLICATED = Placement()
IN_REGION = Placement(in_region=True)


@dataclass(frozen=True)
class Leaf:
    path: str                   # a top-level name, or "blocks.<i>.<name>"
    shape: tuple[int, ...]      # ours: linear weights are [out, in]
    init: str                   # "ones", "zeros", or a normal draw whose std ``ModelSpec.init_std`` gives
    placement: Placement = REPLICATED
    trainable: bool = True      # False: a frozen base weight under adapters (no gradient, no optimizer state)


BlockLeaf = tuple[str, tuple[int, ...], str, Placement]  # a block's leaf: (name, shape, init, placement)


def check_sizes(cfg: Any, *names: str) -> None:
    """A config's ``names`` must each be >= 1 (its ``__post_init__`` calls this)."""
    for name in names:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name}={getattr(cfg, name)} must be >= 1")


@dataclass(frozen=True)
class Unit:
    """What an engine moves, updates and hands over as one piece: its leaves in a fixed order."""
    name: str                   # "embed", "blocks.3", or the head's name
    paths: tuple[str, ...]
    index: int | None = None    # a block's number


@dataclass(frozen=True)
class Costs:
    """The numbers every planner and the MFU reading use, counted once from the leaves' shapes.

    Activation bytes are per token per block at 2 bytes an element (bf16; scale by the dtype), with
    fused attention, by recompute policy: ``none`` keeps every activation, ``lean`` recomputes only the
    norms and the activation function, ``selective`` the MLP, ``every`` keeps the block's input only;
    ``none``'s bytes are also what a block holds while it is recomputed; ``compiled``: what a block compiled by
    ``torch.compile`` (inductor) saves without recompute.
    """
    n_layer: int
    width: int                  # the residual stream's features: what crosses a block boundary per token
    vocab: int
    embed_params: int
    block_params: int
    head_params: int            # the head unit's own leaves (final norm; the output matrix when untied)
    lookup_params: int          # parameters only looked up, never multiplied (position table, untied embedding)
    last_matmul: int            # parameters of a block's last matmul (streaming's recompute skips it)
    attention_width: int        # query heads x head dim: a token's attention FLOPs are 4 x this x positions
    act_bytes: tuple[tuple[str, int], ...]  # (recompute policy, bytes per token per block)
    frozen_matmul: int = 0      # multiplied parameters that are frozen (a base under adapters): no weight gradient

    def activation_bytes(self, policy: str) -> int:
        return dict(self.act_bytes)[policy]

    @property
    def total_params(self) -> int:
        return self.embed_params + self.n_layer * self.block_params + self.head_params

    def block_forward_flops(self, seq: int) -> float:
        """FLOPs per token of one block's forward, causal attention (half the square) at ``seq``."""
        return 2.0 * self.block_params + 2.0 * seq * self.attention_width

    def block_recompute_flops(self, seq: int) -> float:
        """The recompute that stops short of the block's last matmul (``core.recompute.block_grads``)."""
        return self.block_forward_flops(seq) - 2.0 * self.last_matmul

    def head_flops(self) -> float:
        return 2.0 * self.width * self.vocab

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token as nanoGPT and PaLM count them: 6 per multiplied parameter (4 for a frozen one,
        whose weight gradient is not computed), and 12 L x attention width x seq for the attention scores and
        values (the full square)."""
        return (6.0 * (self.total_params - self.lookup_params) - 2.0 * self.frozen_matmul
                + 12.0 * self.n_layer * self.attention_width * seq)


@dataclass(frozen=True)
class Dropout:
    embed: float = 0.0
    attention: float = 0.0      # on the attention weights
    residual: float = 0.0       # on each sublayer's output before the residual add
    lora: float = 0.0           # on the input of each LoRA pair (``models.lora``)

    @property
    def any(self) -> bool:
        return max(self.embed, self.attention, self.residual, self.lora) > 0

    def __str__(self) -> str:
        """The rates in use, e.g. "embed 0.1, attention 0.1" (for messages: the zeros say nothing)."""
        return ", ".join(f"{k} {v:g}" for k, v in vars(self).items() if v) or "none"


@dataclass(frozen=True)
class ModelSpec:
    """One model: its family, config, leaves and units, its pieces against ``Ops``, its costs.

    The block is ``h = x + dropout(attention(p, x)); y = h + dropout(ops.act_row(mlp_in(p, h), act, w, b))``
    with ``w, b`` the leaves named by ``mlp_out`` (``models.run`` composes it, once for every family).
    """
    family: str
    cfg: Any
    leaves: tuple[Leaf, ...]            # every parameter, in checkpoint order
    units: tuple[Unit, ...]             # in forward order: embed, blocks..., head
    fp32_moments: tuple[str, ...]       # leaves whose Adam moments stay 32-bit under 8-bit moments
    attn_keys: tuple[str, ...]          # a block's leaves read by its attention sublayer
    mlp_keys: tuple[str, ...]           # ... by its MLP sublayer (``mlp_out`` last)
    mlp_out: tuple[str, str | None]     # the block's last matmul: weight and bias (None: no bias)
    heads: tuple[int, int, int]         # query heads, key/value heads, head dim
    mlp_width: int                      # the MLP's hidden neurons
    n_ctx: int                          # the longest sequence the model takes
    vocab_size: int
    width: int                          # the residual stream's features
    act_bytes: tuple[tuple[str, int], ...]  # ``Costs.act_bytes``: the family's count of what autograd keeps
    dropout: Dropout
    # (params, tokens, ops, seed) -> x, the embedding unit's output
    embed: Callable[[Tree, torch.Tensor, Any, int | None], torch.Tensor]
    # (block params, x, ops, generator) -> the attention sublayer's output, before dropout and residual
    attention: Callable[[dict, torch.Tensor, Any, Any], torch.Tensor]
    # (block params, h, ops) -> the MLP's first matmul's output, before the activation
    mlp_in: Callable[[dict, torch.Tensor, Any], torch.Tensor]
    act: Callable[[torch.Tensor], torch.Tensor]  # the MLP's activation (elementwise, or gated on two halves)
    final_norm: Callable[[Tree, torch.Tensor], torch.Tensor]  # (params, x) -> normalised x
    head_weight: str                    # the leaf the head multiplies with (the embedding when tied)
    init_std: Mapping[str, float]       # a leaf's ``init`` -> the std of its normal draw
    # LoRA target name -> (block leaf, segment of its rows: an index into ``segment_rows``, None for all rows):
    # which of the family's matrices a target means (``models.lora``)
    lora_targets: tuple[tuple[str, str, int | None], ...] = ()
    adapters: tuple[Any, ...] = ()      # the ``models.lora.Adapter``s of an adapted spec (``lora.with_lora``)
    window: int | None = None           # sliding-window attention's span: it bounds ``n_ctx`` where it is shorter

    @property
    def n_layer(self) -> int:
        return len(self.units) - 2

    @property
    def longest(self) -> str:
        """What bounds a sequence, for messages: the context, or a sliding window shorter than it (past the window,
        windowed attention is no longer causal attention, which is what is built)."""
        if self.window is not None and self.window == self.n_ctx:
            return f"sliding window of {self.n_ctx} tokens (longer sequences' windowed attention is not built)"
        return f"context of {self.n_ctx} tokens"

    @cached_property
    def costs(self) -> Costs:
        """Counted from the leaves' shapes (every block has the first one's)."""
        def params(paths: Sequence[str]) -> int:
            return sum(math.prod(self.leaf(p).shape) for p in paths)
        block = self.block_units[0].paths if self.n_layer else ()
        last = [p for p in block if p.rsplit(".", 1)[1] in self.mlp_out]
        lookup = [p for p in self.embed_unit.paths if p != self.head_weight]
        frozen = [leaf.path for leaf in self.leaves if not leaf.trainable and leaf.path not in lookup]
        return Costs(n_layer=self.n_layer, width=self.width, vocab=self.vocab_size,
                     embed_params=params(self.embed_unit.paths), block_params=params(block),
                     head_params=params(self.head_unit.paths),
                     lookup_params=params(lookup), last_matmul=params(last),
                     attention_width=self.heads[0] * self.heads[2], act_bytes=self.act_bytes,
                     frozen_matmul=params(frozen))

    @property
    def embed_unit(self) -> Unit:
        return self.units[0]

    @property
    def head_unit(self) -> Unit:
        return self.units[-1]

    @property
    def block_units(self) -> tuple[Unit, ...]:
        return self.units[1:-1]

    def leaf(self, path: str) -> Leaf:
        return self._by_path[path]

    def segment_rows(self, leaf: Leaf) -> list[int]:
        """The whole leaf's rows along its placement's dim, per segment: the axis's heads, neurons or vocabulary
        rows, times the segment's rows per element."""
        count = {Q_HEADS: self.heads[0], KV_HEADS: self.heads[1], NEURONS: self.mlp_width, VOCAB: self.vocab_size}
        return [count[axis] * rows for axis, rows in leaf.placement.segments]

    @cached_property
    def _by_path(self) -> dict[str, Leaf]:
        return {leaf.path: leaf for leaf in self.leaves}

    @property
    def block_keys(self) -> tuple[str, ...]:
        """A block's leaf names, in checkpoint order (every block has the same)."""
        return tuple(p.split(".", 2)[2] for p in self.units[1].paths) if self.n_layer else ()

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Leaf path -> shape (built once: the checkpoint readers look leaves up one by one)."""
        return {leaf.path: leaf.shape for leaf in self.leaves}

    def head_paths(self) -> tuple[str, ...]:
        """Every leaf the head reads: its unit's, and the tied embedding's output matrix."""
        own = self.head_unit.paths
        return own if self.head_weight in own else (*own, self.head_weight)

    def unit_of(self) -> dict[str, str]:
        """Leaf path -> the name of its unit."""
        return {path: unit.name for unit in self.units for path in unit.paths}

    def unit_dict(self) -> dict[str, list[str]]:
        """Unit name -> its leaf paths, in forward order."""
        return {unit.name: list(unit.paths) for unit in self.units}

    def trainable_units(self) -> dict[str, list[str]]:
        """Unit name -> its trainable leaf paths (what the optimizers take), units with none left out."""
        units = {unit.name: [p for p in unit.paths if self.leaf(p).trainable] for unit in self.units}
        return {name: paths for name, paths in units.items() if paths}

    @property
    def frozen(self) -> bool:
        """Whether some leaves are frozen (a base under adapters)."""
        return any(not leaf.trainable for leaf in self.leaves)


def stack(embed: Sequence[Leaf], attn: Sequence[BlockLeaf], mlp: Sequence[BlockLeaf], n_layer: int,
          head: Sequence[Leaf], head_name: str) -> dict[str, tuple]:
    """A family's ``ModelSpec`` fields ``leaves`` (checkpoint order: the embedding unit's, ``n_layer`` blocks
    of the attention's then the MLP's, the head unit's), ``units`` (forward order; the head's named
    ``head_name``), ``attn_keys`` and ``mlp_keys``."""
    blocks = [tuple(Leaf(f"blocks.{i}.{name}", *rest) for name, *rest in (*attn, *mlp)) for i in range(n_layer)]
    units = (Unit("embed", tuple(leaf.path for leaf in embed)),
             *(Unit(f"blocks.{i}", tuple(leaf.path for leaf in b), i) for i, b in enumerate(blocks)),
             Unit(head_name, tuple(leaf.path for leaf in head)))
    return dict(leaves=(*embed, *(leaf for b in blocks for leaf in b), *head), units=units,
                attn_keys=tuple(name for name, *_ in attn), mlp_keys=tuple(name for name, *_ in mlp))
