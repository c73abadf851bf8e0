"""A model as a chain of pure layers over one parameter tree, and how to cut it into stages.

The pipeline needs three things from a model: the layers in order, which leaves of the
parameter tree each one reads, and a cost per layer to balance stages. The first layer (a
language model's embedding) always lives on the first stage and the head with the loss on the
last; the layers in between are split by counts or by cost. A parameter read on two ranks (a tied
embedding, read by the embedding and the head) is a copy on each; their gradients are summed after
backward. ``LayeredModel.from_spec`` makes any ``ModelSpec`` such a chain.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from nanotrain.core.loss import target_count
from nanotrain.core.recompute import recompute as recomputed
from nanotrain.core.models import run
from nanotrain.core.models.documents import Documents
from nanotrain.core.models.ops import PLAIN, PlainOps
from nanotrain.core.models.registry import model_spec
from nanotrain.core.models.spec import ModelSpec, Unit
from nanotrain.core.tree import Tree
OpsFor = Callable[[torch.Tensor], PlainOps]  # a layer's input (tokens or activations) -> the ops to compute it with
BlockCall = Callable[..., torch.Tensor]  # (spec, block leaves, x, ops, seed) -> out: run.block, or compiled


@dataclass(frozen=True)
class Layer:
    name: str
    paths: tuple[str, ...]  # parameter leaves it reads
    # (params, x[, seed]) -> y; seed: the micro-batch's dropout seed, if any; a language model's layers
    # (``from_spec``) also take ``docs=``, packed rows' ``Documents``
    apply: Callable[..., torch.Tensor]
    cost: float = 1.0


@dataclass(frozen=True)
class Head:
    paths: tuple[str, ...]
    # (params, x, targets, denom) -> sum of per-example losses / denom (``from_spec``'s also takes ``docs=``)
    loss: Callable[..., torch.Tensor]
    cost: float = 1.0


@dataclass(frozen=True)
class LayeredModel:
    first: Layer | None  # always on the first stage
    layers: tuple[Layer, ...]  # split between stages
    head: Head  # always on the last stage
    shapes: Mapping[str, tuple[int, ...]]  # every parameter leaf
    init: Callable[[int], Iterator[tuple[str, torch.Tensor]]]  # seed -> (path, tensor), in a fixed order
    skeleton: Callable[[], Tree]  # the tree with no tensors in it
    denominator: Callable[[torch.Tensor], float | int]  # the whole batch's targets -> loss denominator

    @classmethod
    def from_spec(cls, model: Any, seq_len: int | None = None, sublayers: bool = False, ops: OpsFor | None = None,
                  recompute: bool = False, seeded: bool = False, block: BlockCall = run.block) -> LayeredModel:
        """Any family's model (config or spec) as layers: its embedding, one layer per block, its final norm and
        loss, costed in forward FLOPs per token at ``seq_len`` (default: the context; ``spec.costs``).

        ``sublayers``: each block is two layers, its attention and its MLP, so stages can be balanced twice as
        finely: with whole blocks, gpt2-xl's 48 blocks, embedding and head split 4 ways leave one stage about 3%
        above the mean, the pipeline's pace. ``ops``: the ops each layer computes with, from its input (default
        the plain ones; ``compose.layered`` gives tensor-parallel ones). ``recompute``: each block (or
        sublayer) keeps only its input and runs again in backward. ``block``: what computes a whole block
        (``run.block``, or ``compose.layered``'s compiled between the collectives).

        Dropout masks come from the seed ``StageSpec.forward`` is given for the micro-batch (None: none, as in
        evaluation), each block's from it as in one process (``run.block_seed``). ``seeded``: the caller hands
        every micro-batch the single process's seed (the 3D trainer); without, a model with dropout is refused
        rather than trained without it.
        """
        spec = model_spec(model)
        if spec.dropout.any and not seeded:
            raise ValueError(f"pipeline training needs dropout off ({spec.dropout}): a micro-batch cannot replay "
                             f"the single-process dropout masks; set the config's dropout probabilities to 0")
        ops = ops or _plain
        layers = tuple(layer for unit in spec.block_units for layer in _block_layers(spec, unit, seq_len or spec.n_ctx,
                                                                                     sublayers, ops, recompute, block))
        return cls(first=Layer(spec.embed_unit.name, spec.embed_unit.paths, partial(_embed, spec, ops), cost=0.0),
                   layers=layers, head=Head(spec.head_paths(), partial(_head, spec, ops), cost=spec.costs.head_flops()),
                   shapes=spec.shapes, init=partial(run.init_stream, spec), skeleton=partial(run.empty_tree, spec),
                   denominator=target_count)


@dataclass(frozen=True)
class StageSpec:
    index: int
    n_stages: int
    first: Layer | None
    layers: tuple[Layer, ...]
    head: Head | None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    @property
    def cost(self) -> float:
        """Its layers' costs, its first layer and head included: what ``partition`` balances."""
        return (sum(layer.cost for layer in self.layers) + (self.first.cost if self.first else 0.0)
                + (self.head.cost if self.head else 0.0))

    def paths(self) -> set[str]:
        parts = [layer.paths for layer in self.layers]
        parts += [self.first.paths if self.first else (), self.head.paths if self.head else ()]
        return {p for ps in parts for p in ps}

    def forward(self, params: Tree, x: torch.Tensor, targets: torch.Tensor | None = None,
                denom: float | None = None, seed: int | None = None, docs: Documents | None = None) -> torch.Tensor:
        """The stage's output, or on the last stage its share of the batch loss; ``seed``: the micro-batch's
        dropout seed (``core.train.step.dropout_seed``); ``docs``: its packed rows (``core.models.documents``),
        which every stage's layers attend and embed by."""
        seeded = () if seed is None else (seed,)  # a model without dropout takes (params, x)
        kw = {} if docs is None else {"docs": docs}
        if self.first is not None:
            x = self.first.apply(params, x, *seeded, **kw)
        for layer in self.layers:
            x = layer.apply(params, x, *seeded, **kw)
        if self.head is not None:
            return self.head.loss(params, x, targets, denom, **kw)
        return x


def split_by_counts(n_layers: int, counts: Sequence[int]) -> list[range]:
    if sum(counts) != n_layers or min(counts) < 1:
        raise ValueError(f"stage layer counts {list(counts)} must be >= 1 each and sum to the model's {n_layers} "
                         f"layers, e.g. {_even_counts(n_layers, len(counts))}")
    bounds = [0, *accumulate(counts)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def _even_counts(n_layers: int, n_stages: int) -> list[int]:
    return [n_layers // n_stages + (i < n_layers % n_stages) for i in range(n_stages)]


def split_balanced(costs: Sequence[float], n_stages: int, first_cost: float = 0.0,
                   head_cost: float = 0.0) -> list[range]:
    """Contiguous split minimising the most expensive stage (the pipeline's pace).

    ``first_cost`` and ``head_cost`` are added to the first and last stage. Exact dynamic
    programme over split points; ties go to the earliest split.
    """
    return list(_split_balanced(tuple(costs), n_stages, first_cost, head_cost))


@functools.cache  # the 3D planner splits the same layers into the same stages for every layout it weighs
def _split_balanced(costs: tuple[float, ...], n_stages: int, first_cost: float, head_cost: float) -> tuple[range, ...]:
    n = len(costs)
    if n < n_stages:
        raise ValueError(f"cannot split {n} layers into {n_stages} stages (each stage needs at least one layer); "
                         f"use at most {n} stages or a deeper model")
    prefix = [0.0, *accumulate(costs)]
    inf = float("inf")
    # best[s][i]: least max-cost of the first s stages covering layers [0, i); cut[s][i] the last split.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):
                cost = prefix[i] - prefix[j] + (first_cost if s == 1 else 0.0) + (head_cost if s == n_stages else 0.0)
                value = max(best[s - 1][j], cost)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [n], n
    for s in range(n_stages, 0, -1):
        i = cut[s][i]
        bounds.append(i)
    bounds.reverse()
    return tuple(range(a, b) for a, b in zip(bounds, bounds[1:], strict=False))


def partition(model: LayeredModel, n_stages: int, counts: Sequence[int] | None = None) -> list[StageSpec]:
    """The model's stages: by ``counts`` of middle layers per stage, or balanced by layer cost."""
    if counts is not None and len(counts) != n_stages:
        raise ValueError(f"got {len(counts)} stage layer counts for {n_stages} stages")
    if counts is not None:
        ranges = split_by_counts(len(model.layers), counts)
    else:
        first_cost = model.first.cost if model.first else 0.0
        ranges = split_balanced([layer.cost for layer in model.layers], n_stages, first_cost, model.head.cost)
    return [StageSpec(s, n_stages, model.first if s == 0 else None, tuple(model.layers[i] for i in rng),
                      model.head if s == n_stages - 1 else None) for s, rng in enumerate(ranges)]


def describe(specs: Sequence[StageSpec]) -> str:
    """One line per stage naming its layers, e.g. ``stage 0: embed, block0, block1``."""
    lines = []
    for spec in specs:
        names = ([spec.first.name] if spec.first else []) + [layer.name for layer in spec.layers]
        lines.append(f"stage {spec.index}: {', '.join(names)}{' + head' if spec.head else ''}")
    return "\n".join(lines)


def reference_loss(model: LayeredModel, params: Tree, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The whole model on the whole batch in one process: what the pipeline must reproduce."""
    whole = StageSpec(0, 1, model.first, model.layers, model.head)
    return whole.forward(params, inputs, targets, model.denominator(targets))


# -- a ModelSpec's layers (``LayeredModel.from_spec``) -----------------------------------------


def _plain(x: torch.Tensor) -> PlainOps:
    return PLAIN


def _embed(spec: ModelSpec, ops: OpsFor, params: Tree, tokens: torch.Tensor,
           seed: int | None = None, docs: Documents | None = None) -> torch.Tensor:
    return spec.embed(params, tokens, ops(tokens).with_documents(docs), seed)


def _sublayer(spec: ModelSpec, part: str, ops: PlainOps, block: BlockCall, p: dict, x: torch.Tensor,
              seed: int | None) -> torch.Tensor:
    """The block (through ``block``: compiled under ``--compile``), its attention or its MLP, each with its
    residual add; ``seed``: the block's dropout seed."""
    if part == "block":
        return block(spec, p, x, ops, seed)
    gen_attn, gen_mlp = run.generators(seed, x.device)
    if part == "attn":
        return run.attention_residual(spec, p, x, ops, gen_attn)
    return x + run.mlp(spec, p, x, ops, gen_mlp)


def _layer(spec: ModelSpec, index: int, part: str, keys: tuple[str, ...], ops: OpsFor, recompute: bool,
           block: BlockCall, params: Tree, x: torch.Tensor, seed: int | None = None,
           docs: Documents | None = None) -> torch.Tensor:
    p = params["blocks"][index]

    def fn(x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:  # the same masks again when recomputed
        return _sublayer(spec, part, ops(x).with_documents(docs), block, dict(zip(keys, weights)), x,
                         run.block_seed(seed, index))

    weights = [p[k] for k in keys]
    return recomputed(fn, x, *weights) if recompute else fn(x, *weights)


def _matmul_flops(spec: ModelSpec, paths: Sequence[str]) -> float:
    """Forward FLOPs per token of the matmuls of these leaves: 2 per element of each matrix (norms and biases
    are elementwise, a rounding error beside them)."""
    return 2.0 * sum(math.prod(spec.leaf(p).shape) for p in paths if len(spec.leaf(p).shape) == 2)


def _block_layers(spec: ModelSpec, unit: Unit, seq: int, sublayers: bool, ops: OpsFor,
                  recompute: bool, block: BlockCall = run.block) -> tuple[Layer, ...]:
    """Block ``unit`` as one layer or two, costed in forward FLOPs per token: its matmuls, and for the attention
    4 x its width x ``seq`` for the scores and values over the full square, as ``Costs.flops_per_token`` counts
    them. For GPT-2 that is 24 C^2 + 4 T C a block (8 C^2 + 4 T C the attention, 16 C^2 the MLP), as the stage
    splits always were; the causal half would move them."""
    i, attention = unit.index, 4.0 * seq * spec.costs.attention_width
    parts = (("block", spec.block_keys, attention),) if not sublayers else (
        ("attn", spec.attn_keys, attention), ("mlp", spec.mlp_keys, 0.0))
    out = []
    for part, keys, extra in parts:
        paths = tuple(path for path in unit.paths if path.rsplit(".", 1)[1] in keys)
        out.append(Layer(f"block{i}" if part == "block" else f"block{i}.{part}", paths,
                         partial(_layer, spec, i, part, keys, ops, recompute, block),
                         cost=_matmul_flops(spec, paths) + extra))
    return tuple(out)


def _head(spec: ModelSpec, ops: OpsFor, params: Tree, x: torch.Tensor, targets: torch.Tensor,
          denom: float, docs: Documents | None = None) -> torch.Tensor:
    # Gradients in backward (the plain ops): the last stage then runs one forward to two backwards like the others.
    return run.head_loss(spec, params, x, targets, ops(x).with_documents(docs), denom, keep_logits=True)

