"""Where a trainer takes its starting weights from: a model's leaves by tree path, their shapes known before any is
read, each read when the trainer takes it (from a checkpoint's files: ``weights.open_weights``; made from a seed:
``seeded``; or let go of by a tree held whole: ``held``).

An engine that keeps its state unit by unit (the streamed one: ``stream.optimizer``) takes the leaves of a unit,
keeps what it keeps of them and lets them go before the next unit's are read, so the host never holds the model
twice, nor once in fp32 where it keeps it in 4 bits; a data-parallel rank keeps its share of each leaf as it passes
(``rank_load_bytes``); an engine that wants the tree whole builds it (``tree_of``).
``load_peak`` is the host memory of taking them that way, the one arithmetic every plan of a load reads.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from nanotrain.core.models import run
from nanotrain.core.models.spec import ModelSpec
from nanotrain.core.tree import Tree, named_leaves, set_path


@dataclass(frozen=True)
class Leaves:
    """Leaves by tree path, their shapes known before any is read: ``read(path)`` gives one, whole, in the dtype and
    on the device its source has it (a checkpoint's in its file's dtype on the host, a seed's where it was made); a
    trainer converts it as it keeps it. Each is read once."""
    shapes: dict[str, tuple[int, ...]]
    read: Callable[[str], torch.Tensor]


Start = Tree | Leaves  # what a trainer starts from: leaves to take, or a tree built whole (``held``)


def held(tree: Tree) -> Leaves:
    """The leaves of a tree built whole, each let go of (in the tree too) as it is read: the trainer's copy replaces
    the caller's, so the model is not held twice."""
    named = {path: t for path, t in named_leaves(tree) if t is not None}

    def read(path: str) -> torch.Tensor:
        t = named.pop(path)
        set_path(tree, path, None)
        return t

    return Leaves({path: tuple(t.shape) for path, t in named.items()}, read)


def as_leaves(params: Start) -> Leaves:
    """What a trainer takes its weights from: ``params`` itself, or a tree's leaves let go of as they are taken."""
    return params if isinstance(params, Leaves) else held(params)


def joined(*parts: Leaves) -> Leaves:
    """One model's leaves from several sources (a base's and its adapters'), each path read from the one that has it."""
    owner = {path: part for part in parts for path in part.shapes}
    return Leaves({path: shape for part in parts for path, shape in part.shapes.items()},
                  lambda path: owner[path].read(path))


def tree_of(spec: ModelSpec, leaves: Leaves, dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu") -> Tree:
    """The parameter tree of ``spec`` read whole from ``leaves``, each converted to ``dtype`` on ``device`` as read."""
    return run.tree_from(spec, ((leaf.path, leaves.read(leaf.path).to(device=device, dtype=dtype).contiguous())
                                for leaf in spec.leaves))


def seeded(spec: ModelSpec, seed: int, device: torch.device | str = "cpu",
           dtype: torch.dtype = torch.float32) -> Leaves:
    """``spec``'s leaves made from ``seed`` as they are read, on ``device``, rounded to ``dtype`` (a model in the
    compute dtype): ``init_stream``'s, one generator drawn in the spec's order, so read in that order (a leaf
    skipped is drawn and dropped; one read after a later one is refused). The same seed gives the same leaves on
    the same kind of device (the CPU's draws differ from a GPU's); on the CPU in fp32 they are ``init_params``'."""
    stream = run.init_stream(spec, seed, device)
    passed: set[str] = set()

    def read(path: str) -> torch.Tensor:
        if path in passed:
            raise ValueError(f"seeded leaves are drawn in the model's order: {path} was passed already (read the "
                             f"leaves in the order of the spec's units)")
        for name, t in stream:
            passed.add(name)
            if name == path:
                return t.to(dtype)
        raise KeyError(path)

    return Leaves(dict(spec.shapes), read)


def nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The paths of the tensors that hold inf or NaN."""
    return [path for path, t in named if isinstance(t, torch.Tensor) and not torch.isfinite(t).all()]


class Loading:
    """A load watched as it goes: every ``every_s`` seconds a line of the units and parameters taken so far (a 70B
    model takes minutes), and the leaves found non-finite (``bad``)."""

    def __init__(self, spec: ModelSpec, what: str, every_s: float = 5.0):
        self.unit_of, self.what, self.every_s = spec.unit_of(), what, every_s
        self.left = {unit.name: len(unit.paths) for unit in spec.units}
        self.total, self.params, self.done = spec.costs.total_params, 0, 0
        self.bad: list[str] = []
        self._start = self._said = time.monotonic()

    def watch(self, leaves: Leaves) -> Leaves:
        """``leaves`` whose reads are counted and checked."""
        def read(path: str) -> torch.Tensor:
            t = leaves.read(path)
            self.bad += nonfinite([(path, t)])
            self.params += t.numel()
            unit = self.unit_of[path]
            self.left[unit] -= 1
            self.done += self.left[unit] == 0
            now = time.monotonic()
            # every few seconds, and at the end of a load that took that long
            if now - self._said >= self.every_s or self.done == len(self.left) and now - self._start >= self.every_s:
                self._said = now
                self.say(now)
            return t

        return Leaves(leaves.shapes, read)

    def say(self, now: float) -> None:
        print(f"loading {self.what}: {self.done}/{len(self.left)} units, {self.params / 1e9:.2f}B of "
              f"{self.total / 1e9:.2f}B parameters, {now - self._start:.0f} s", flush=True)


def in_flight(numel: int, read_bytes: int, becomes: int = 0) -> int:
    """A leaf in flight while a trainer takes it: twice its ``numel`` elements of ``read_bytes`` (a fused leaf's parts
    and the leaf joined from them; a transposed one and its contiguous copy) and what it ``becomes`` before it is kept
    (its NF4 codes: the quantisation's own temporaries are a chunk's, ``core.nf4``)."""
    return 2 * numel * read_bytes + becomes


def load_peak(units: Iterable[tuple[int, int]]) -> int:
    """Host bytes at the peak of taking a model's leaves unit by unit from a reader. Per unit, in the order taken:
    (what the trainer keeps of it, the most it has in flight while taking it: a leaf as read and what it becomes
    before it is kept). The kept bytes pile up; the peak is at a unit's end, with its leaf in flight."""
    done, peak = 0, 0
    for kept, flight in units:
        peak = max(peak, done + kept + flight)
        done += kept
    return peak


def rank_load_bytes(spec: ModelSpec, read_bytes: int, kept: Callable[[str], float]) -> int:
    """Host bytes at the peak of a data-parallel rank's load (``data_parallel.shards.take``): each leaf read in
    ``read_bytes`` an element and in flight until the rank has cut from it what it keeps on the host, ``kept(path)``
    bytes (its share of the masters and moments where they live there, none where they live on the GPU)."""
    def numel(path: str) -> int:
        return math.prod(spec.leaf(path).shape)

    return load_peak((math.ceil(sum(map(kept, u.paths))), max(in_flight(numel(p), read_bytes) for p in u.paths))
                     for u in spec.units)
