"""A model as a chain of pure layers over one parameter tree, and how to cut it into stages.

The pipeline needs three things from a model: the layers in order, which leaves of the
parameter tree each one reads, and a cost per layer to balance stages. The first layer (GPT-2's
embedding) always lives on the first stage and the head with the loss on the last; the layers
in between are split by counts or by cost. A parameter read on two ranks (GPT-2's ``wte``, the
embedding and the tied LM head) is a copy on each; their gradients are summed after backward.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping, Sequence

import torch

from nanotrain.tree import Tree, tree_map


@dataclass(frozen=True)
class Layer:
    name: str
    paths: tuple[str, ...]  # parameter leaves it reads
    apply: Callable[[Tree, torch.Tensor], torch.Tensor]  # (params, x) -> y
    cost: float = 1.0


@dataclass(frozen=True)
class Head:
    paths: tuple[str, ...]
    # (params, x, targets, denom) -> sum of per-example losses / denom
    loss: Callable[[Tree, torch.Tensor, torch.Tensor, float], torch.Tensor]
    cost: float = 1.0


@dataclass(frozen=True)
class LayeredModel:
    first: Layer | None  # always on the first stage
    layers: tuple[Layer, ...]  # split between stages
    head: Head  # always on the last stage
    shapes: Mapping[str, tuple[int, ...]]  # every parameter leaf
    init: Callable[[int], Iterator[tuple[str, torch.Tensor]]]  # seed -> (path, tensor), in a fixed order
    skeleton: Callable[[], Tree]  # the tree with no tensors in it
    denominator: Callable[[torch.Tensor], float]  # the whole batch's targets -> loss denominator


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

    def paths(self) -> set[str]:
        parts = [layer.paths for layer in self.layers]
        parts += [self.first.paths if self.first else (), self.head.paths if self.head else ()]
        return {p for ps in parts for p in ps}

    def forward(self, params: Tree, x: torch.Tensor, targets: torch.Tensor | None = None,
                denom: float | None = None) -> torch.Tensor:
        """The stage's output, or on the last stage its share of the batch loss."""
        if self.first is not None:
            x = self.first.apply(params, x)
        for layer in self.layers:
            x = layer.apply(params, x)
        if self.head is not None:
            return self.head.loss(params, x, targets, denom)
        return x


def split_by_counts(n_layers: int, counts: Sequence[int]) -> list[range]:
    if sum(counts) != n_layers or min(counts) < 1:
        raise ValueError(f"stage layer counts {list(counts)} must be >= 1 each and sum to the model's {n_layers} "
                         f"layers, e.g. {_even_counts(n_layers, len(counts))}")
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def _even_counts(n_layers: int, n_stages: int) -> list[int]:
    return [n_layers // n_stages + (i < n_layers % n_stages) for i in range(n_stages)]


def split_balanced(costs: Sequence[float], n_stages: int, first_cost: float = 0.0,
                   head_cost: float = 0.0) -> list[range]:
    """Contiguous split minimising the most expensive stage (the pipeline's pace).

    ``first_cost`` and ``head_cost`` are added to the first and last stage. Exact dynamic
    programme over split points; ties go to the earliest split.
    """
    n = len(costs)
    if n < n_stages:
        raise ValueError(f"cannot split {n} layers into {n_stages} stages (each stage needs at least one layer); "
                         f"use at most {n} stages or a deeper model")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
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
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


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


def computing_in(model: LayeredModel, dtype: torch.dtype) -> LayeredModel:
    """``model`` with its layers and head computing in ``dtype`` (fp16) from parameters kept in theirs (fp32,
    the optimizer's masters): each casts the leaves it reads, and its float input, as it runs; autograd
    brings the gradients back in the parameters' dtype. Activations then travel between stages in ``dtype``."""
    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def layer(one: Layer) -> Layer:
        return replace(one, apply=lambda p, x: one.apply(tree_map(cast, p), cast(x)))

    head = replace(model.head, loss=lambda p, x, t, d: model.head.loss(tree_map(cast, p), cast(x), t, d))
    return replace(model, first=model.first and layer(model.first), layers=tuple(map(layer, model.layers)), head=head)
