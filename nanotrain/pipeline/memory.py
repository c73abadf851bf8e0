"""Activation bytes alive on a rank, counted on any device: the CPU stand-in for max_memory_allocated.

Counts every storage autograd saved for backward (through saved-tensor hooks) plus the tensors
the executor holds (stage inputs, received buffers, outputs still being sent, W-pass inputs),
each storage once, parameters excluded.
"""
from __future__ import annotations

import weakref
from itertools import chain
from typing import Iterable

import torch


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ActivationMeter:
    def __init__(self, params: Iterable[torch.Tensor]):
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._saved: weakref.WeakSet[_Saved] = weakref.WeakSet()
        self.peak = 0

    def saving(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Context manager for the forward pass: routes saved tensors through the meter."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> _Saved:
        box = _Saved(t)
        self._saved.add(box)
        return box

    @staticmethod
    def _unpack(box: _Saved) -> torch.Tensor:
        return box.tensor

    def sample(self, held: Iterable[torch.Tensor]) -> int:
        storages = {}
        for t in chain((box.tensor for box in list(self._saved)), held):
            s = t.untyped_storage()
            if s.data_ptr() not in self._params:
                storages[s.data_ptr()] = s.nbytes()
        now = sum(storages.values())
        self.peak = max(self.peak, now)
        return now
