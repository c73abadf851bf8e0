"""CIFAR-10 images and a small CNN written as pure layers over plain tensors.

``load_cifar10`` uses torchvision when it can be imported and the data found or downloaded;
otherwise it prints why and returns a synthetic stand-in of the same shapes (ten classes of
noisy fixed templates), so demos and tests run on machines without torchvision or network.
``make_cnn_layers`` returns the CNN as ``FnLayer``s: ``init(generator) -> {name: tensor}`` and
``apply(params, x) -> y``, the same functional style as the language models (``nanotrain.core.models``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from nanotrain.core.linear import linear
N_CLASSES = 10
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
SYNTHETIC_SIZES = {True: 10_000, False: 2_000}  # train, test


@dataclass(frozen=True)
class FnLayer:
    name: str
    init: Callable[[torch.Generator], dict[str, torch.Tensor]]
    apply: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]
    cost: float  # forward FLOPs per example


def load_cifar10(root: str, train: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(images uint8 [N, 3, 32, 32], labels int64 [N]) from torchvision, else a synthetic stand-in."""
    try:
        import torchvision  # lazy: optional, and absent from CPU-only installs

        ds = torchvision.datasets.CIFAR10(root, train=train, download=True)
        return torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(ds.targets, dtype=torch.int64)
    except Exception as e:  # ImportError, no network, missing or corrupt files: all mean "no real data here"
        n = SYNTHETIC_SIZES[train]
        print(f"CIFAR-10 is not available ({type(e).__name__}: {e}); using a SYNTHETIC stand-in of {n} "
              f"{'train' if train else 'test'} images (10 classes of noisy fixed templates), not real CIFAR-10")
        return synthetic_cifar10(n, seed=0 if train else 1)


def synthetic_cifar10(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable fake CIFAR: each class is a fixed smooth template, each image that template plus noise."""
    templates = F.interpolate(torch.rand(N_CLASSES, 3, 8, 8, generator=torch.Generator().manual_seed(1234)),
                              size=(32, 32), mode="bilinear", align_corners=False)
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, N_CLASSES, (n,), generator=gen)
    images = torch.empty(n, 3, 32, 32, dtype=torch.uint8)
    for start in range(0, n, 1000):  # chunks keep the float intermediate small
        lab = labels[start:start + 1000]
        noisy = 0.3 * templates[lab] + 0.7 * torch.rand(len(lab), 3, 32, 32, generator=gen)
        images[start:start + 1000] = (noisy * 255).round().clamp(0, 255).to(torch.uint8)
    return images, labels


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 3, H, W] -> float32 with CIFAR-10's per-channel mean and std."""
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    return (images.float() / 255.0 - mean) / std


def _normal(shape: tuple[int, ...], fan_in: int, gen: torch.Generator, gain: float = 2.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * (gain / fan_in) ** 0.5


def _conv(cin: int, cout: int, hw: int, pool: bool, name: str) -> FnLayer:
    def init(gen: torch.Generator) -> dict[str, torch.Tensor]:
        return {"w": _normal((cout, cin, 3, 3), cin * 9, gen), "b": torch.zeros(cout)}

    def apply(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        y = F.relu(F.conv2d(x, p["w"], p["b"], padding=1))
        return F.max_pool2d(y, 2) if pool else y

    return FnLayer(name, init, apply, cost=2 * 9 * cin * cout * hw * hw)


def _linear(fin: int, fout: int, relu: bool, name: str) -> FnLayer:
    def init(gen: torch.Generator) -> dict[str, torch.Tensor]:
        return {"w": _normal((fout, fin), fin, gen, gain=2.0 if relu else 1.0), "b": torch.zeros(fout)}

    def apply(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        y = linear(x.flatten(1), p["w"], p["b"])
        return F.relu(y) if relu else y

    return FnLayer(name, init, apply, cost=2 * fin * fout)


def make_cnn_layers(width: int = 32, hidden: int = 128) -> list[FnLayer]:
    """Three conv-conv-pool blocks, then fc-relu and fc -> logits [N, 10]; input [N, 3, 32, 32].

    Eight layers, so it splits into up to eight pipeline stages.
    """
    w = width
    return [
        _conv(3, w, 32, pool=False, name="conv1"),
        _conv(w, w, 32, pool=True, name="conv2"),
        _conv(w, 2 * w, 16, pool=False, name="conv3"),
        _conv(2 * w, 2 * w, 16, pool=True, name="conv4"),
        _conv(2 * w, 4 * w, 8, pool=False, name="conv5"),
        _conv(4 * w, 4 * w, 8, pool=True, name="conv6"),
        _linear(4 * w * 4 * 4, hidden, relu=True, name="fc1"),
        _linear(hidden, N_CLASSES, relu=False, name="fc2"),
    ]


def cnn_loss(logits: torch.Tensor, labels: torch.Tensor, denom: float) -> torch.Tensor:
    """Summed cross-entropy over ``denom``: micro-batch losses add up to the batch mean."""
    return F.cross_entropy(logits.float(), labels, reduction="sum") / denom
