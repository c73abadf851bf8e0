"""Any chain of functional layers (e.g. ``nanotrain.cifar.make_cnn_layers``) as a ``LayeredModel``.

Parameters live at ``layers.<i>.<name>``; the head holds no parameters and only applies the
loss to the last layer's output.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Iterator, Protocol, Sequence

import torch

from nanotrain.pipeline.layered import Head, Layer, LayeredModel
from nanotrain.tree import Tree


class FnLayerLike(Protocol):
    name: str
    cost: float

    def init(self, gen: torch.Generator) -> dict[str, torch.Tensor]: ...
    def apply(self, p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor: ...


def _apply(params: Tree, x: torch.Tensor, index: int, fn: Callable) -> torch.Tensor:
    return fn(params["layers"][index], x)


def _loss(params: Tree, x: torch.Tensor, targets: torch.Tensor, denom: float, fn: Callable) -> torch.Tensor:
    return fn(x, targets, denom)


def _init(layers: Sequence[FnLayerLike], seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    for i, layer in enumerate(layers):
        for name, t in layer.init(gen).items():
            yield f"layers.{i}.{name}", t


def _skeleton(n: int) -> Tree:
    return {"layers": [{} for _ in range(n)]}


def _count(targets: torch.Tensor) -> float:
    return float(targets.numel())


def sequential_layered(layers: Sequence[FnLayerLike],
                       loss: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> LayeredModel:
    """``loss(output, targets, denom)`` must return the summed loss over ``denom`` (the batch size)."""
    shapes = {path: tuple(t.shape) for path, t in _init(layers, 0)}
    return LayeredModel(
        first=None,
        layers=tuple(Layer(layer.name, tuple(p for p in shapes if p.startswith(f"layers.{i}.")),
                           partial(_apply, index=i, fn=layer.apply), cost=layer.cost)
                     for i, layer in enumerate(layers)),
        head=Head((), partial(_loss, fn=loss), cost=0.0),
        shapes=shapes,
        init=partial(_init, tuple(layers)),
        skeleton=partial(_skeleton, len(layers)),
        denominator=_count,
    )
