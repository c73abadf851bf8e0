"""Tensor parallelism for an ``nn.Sequential`` of Linear/Conv2d layers, applied from outside.

``parallelize_sequential`` walks the layers and pairs each Linear (Conv2d) with the next one when
everything between them acts on each feature (channel) separately: activations, BatchNorm,
Dropout, pooling. The first of a pair becomes column-parallel (its slice of the output features),
the layers between run on that slice, the second becomes row-parallel (the matching input
features) and its partial outputs are summed: one all-reduce in forward, one in backward. A layer
that cannot be paired (e.g. the classifier after a Flatten) stays replicated: every rank computes
it whole, alike, and its gradients come out identical on every rank.

A sharded BatchNorm is an ordinary BatchNorm over this rank's features: its statistics are per
feature over a batch every rank holds whole, so it needs no communication, in train or eval. A
sharded Dropout draws the mask of all features from the global generator (seeded alike on every
rank) and keeps its slice, so the result is the single-process one.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from nanotrain.distributed.collectives import Group
from nanotrain.tensor_parallel.comms import all_reduce_copy, copy_all_reduce
from nanotrain.tensor_parallel.shard import partition

FEATUREWISE = (nn.ReLU, nn.GELU, nn.Tanh, nn.SiLU, nn.Sigmoid, nn.BatchNorm1d, nn.BatchNorm2d, nn.Dropout,
               nn.MaxPool2d, nn.AvgPool2d, nn.Identity)


class CopyAllReduce(nn.Module):
    """Identity forward, all-reduce backward: the entrance of a column/row pair."""

    def __init__(self, group: Group):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_all_reduce(x, self.group)


class AllReduceAddBias(nn.Module):
    """Sum the row-parallel partial outputs, then add the bias once."""

    def __init__(self, group: Group, bias: nn.Parameter | None, feature_dim: int):
        super().__init__()
        self.group, self.feature_dim = group, feature_dim
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce_copy(x, self.group)
        if self.bias is None:
            return y
        return y + self.bias.view(-1, *[1] * (y.dim() - 1 - self.feature_dim % y.dim()))


class ShardedDropout(nn.Module):
    """Dropout of this rank's features with its slice of the mask for all ``features``."""

    def __init__(self, p: float, features: range, total: int, feature_dim: int):
        super().__init__()
        self.p, self.features, self.total, self.feature_dim = p, features, total, feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        shape = list(x.shape)
        shape[self.feature_dim] = self.total
        mask = F.dropout(torch.ones(shape, dtype=x.dtype, device=x.device), self.p, training=True)
        return x * mask.narrow(self.feature_dim, self.features.start, len(self.features))

    def extra_repr(self) -> str:
        return f"p={self.p}, features={self.features.start}:{self.features.stop} of {self.total}"


def _out_features(layer: nn.Module) -> int:
    return layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels


def _in_features(layer: nn.Module) -> int:
    return layer.in_features if isinstance(layer, nn.Linear) else layer.in_channels


def _shardable(layer: nn.Module) -> bool:
    return isinstance(layer, nn.Linear) or (isinstance(layer, nn.Conv2d) and layer.groups == 1)


def _row_partner(layers: list[nn.Module], i: int) -> int | None:
    """Index of the layer that can be row-parallel to column-parallel layer ``i``, if any."""
    for j in range(i + 1, len(layers)):
        if not isinstance(layers[j], FEATUREWISE):
            same_kind = type(layers[j]) is type(layers[i]) and _shardable(layers[j])
            return j if same_kind and _in_features(layers[j]) == _out_features(layers[i]) else None
    return None


def _sliced(layer: nn.Module, dim: int, part: range, keep_bias: bool) -> nn.Module:
    """A copy of ``layer`` with ``part`` of its weight's ``dim`` (and of its bias when ``dim`` is 0)."""
    new = copy.deepcopy(layer)
    new.weight = nn.Parameter(layer.weight.detach().narrow(dim, part.start, len(part)).clone())
    if not keep_bias or layer.bias is None:
        new.bias = None
    elif dim == 0:
        new.bias = nn.Parameter(layer.bias.detach()[part.start:part.stop].clone())
    attrs = ("out_features", "in_features") if isinstance(layer, nn.Linear) else ("out_channels", "in_channels")
    setattr(new, attrs[dim], len(part))
    return new


def _sharded_featurewise(layer: nn.Module, part: range, total: int, feature_dim: int) -> nn.Module:
    if isinstance(layer, nn.Dropout):
        return ShardedDropout(layer.p, part, total, feature_dim)
    new = copy.deepcopy(layer)
    if isinstance(layer, (nn.BatchNorm1d, nn.BatchNorm2d)):
        new.num_features = len(part)
        for name in ("weight", "bias"):
            if getattr(layer, name) is not None:
                setattr(new, name, nn.Parameter(getattr(layer, name).detach()[part.start:part.stop].clone()))
        for name in ("running_mean", "running_var"):
            if getattr(layer, name) is not None:
                setattr(new, name, getattr(layer, name)[part.start:part.stop].clone())
    return new


def parallelize_sequential(model: nn.Sequential, group: Group) -> nn.Sequential:
    """This rank's tensor-parallel copy of ``model``; ``model`` itself is left untouched.

    Applied to a copy of the model whose parameters hold gradients, it gives the gradients each
    rank must have (that is how the tests check exactness).
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"parallelize_sequential takes an nn.Sequential, got {type(model).__name__}")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    layers, out, i = list(model), [], 0
    while i < len(layers):
        layer = layers[i]
        j = _row_partner(layers, i) if _shardable(layer) else None
        if j is None:
            out.append(copy.deepcopy(layer))
            i += 1
            continue
        total = _out_features(layer)
        if total < size:
            raise ValueError(f"layer {i} ({layer}) has {total} output features, fewer than the {size} ranks; "
                             f"widen it or use fewer ranks")
        part = partition(total, size, rank)
        # Linear features are the last dim, Conv2d channels are dim 1 of NCHW.
        feature_dim = -1 if isinstance(layer, nn.Linear) else 1
        out += [CopyAllReduce(group), _sliced(layer, 0, part, keep_bias=True)]
        out += [_sharded_featurewise(between, part, total, feature_dim) for between in layers[i + 1:j]]
        out += [_sliced(layers[j], 1, part, keep_bias=False), AllReduceAddBias(group, layers[j].bias, feature_dim)]
        i = j + 1
    return nn.Sequential(*out)
