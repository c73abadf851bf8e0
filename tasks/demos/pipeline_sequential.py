"""Any chain of functional layers (e.g. ``tasks.demos.cifar.make_cnn_layers``) as a ``LayeredModel``.

Parameters live at ``layers.<i>.<name>``; the head holds no parameters and only applies the
loss to the last layer's output.
"""
from __future__ import annotations

from typing import Callable, Iterator, Protocol, Sequence

import torch

from nanotrain.pipeline.layered import Head, Layer, LayeredModel
from nanotrain.core.tree import Tree
class FnLayerLike(Protocol):
    name: str
    cost: float

    def init(self, gen: torch.Generator) -> dict[str, torch.Tensor]: ...
    def apply(self, p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor: ...


def sequential_layered(layers: Sequence[FnLayerLike],
                       loss: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> LayeredModel:
    """``loss(output, targets, denom)`` must return the summed loss over ``denom`` (the batch size)."""
    layers = tuple(layers)

    def init(seed: int) -> Iterator[tuple[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        for i, layer in enumerate(layers):
            for name, t in layer.init(gen).items():
                yield f"layers.{i}.{name}", t

    def apply(i: int) -> Callable[[Tree, torch.Tensor], torch.Tensor]:
        return lambda params, x: layers[i].apply(params["layers"][i], x)

    shapes = {path: tuple(t.shape) for path, t in init(0)}
    return LayeredModel(
        first=None,
        layers=tuple(Layer(layer.name, tuple(p for p in shapes if p.startswith(f"layers.{i}.")), apply(i),
                           cost=layer.cost) for i, layer in enumerate(layers)),
        head=Head((), lambda params, x, targets, denom: loss(x, targets, denom), cost=0.0),
        shapes=shapes,
        init=init,
        skeleton=lambda: {"layers": [{} for _ in layers]},
        denominator=lambda targets: float(targets.numel()),
    )
