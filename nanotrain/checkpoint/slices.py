"""The one checkpoint format: a manifest of leaf slices, read back at any layout.

    step-000100/
      manifest.json                       which file holds which piece of which leaf, the layout saved at
      config.json                         the model (``weights.hf_config``)
      adapter_config.json                 a LoRA run's pairs (``weights.peft``): only they are pieces, the base frozen
      trainer.json                        the step, the data position, the learning-rate schedule
      shard-00000-of-00004.safetensors    one writing rank's pieces (``master.<piece>``, ``exp_avg.<piece>``,
      ...                                 ...) and the step counts (fp16: the loss scaler's state)
      SHA256SUMS                          every file's checksum (``checksums.py``)

Every trainer offers its shard (``core.train.shard``): one process writes one shard of whole leaves. The fp32
masters are the weights: no model file repeats them (``tasks.consolidate`` writes one). A piece (``Piece``) is a flat range of a leaf as its rank holds it: the whole leaf, or the
tensor-parallel shard ``tp = (rank, size)`` that ``tensor_parallel.shard.shard_leaf`` cuts (its rows or
columns, a vocabulary padded). A ZeRO rank holds flat ranges of its leaves (``shards.py``), a DDP replica or
one process whole leaves, a tensor-parallel rank its shards. Reading a piece at another layout copies the
saved ranges of the same tensor-parallel cut, or goes through the whole leaf (``unshard_leaf``, then
``shard_leaf``) where the cut differs: masters and 32-bit moments resume at any layout.

8-bit moments are codes per element and an fp32 absmax per block of ``block`` elements, quantized per leaf
as its rank holds it, in blocks from its start; every piece starts at a multiple of the block, so they resume
at any data-parallel size and ZeRO stage with the same tensor-parallel cut and block (``check``), exactly.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from nanotrain.checkpoint.legacy import is_old, old_manifest
from nanotrain.core.models import model_spec
from nanotrain.core.models.spec import ModelSpec
from nanotrain.core.train.shard import SCALARS, TP, Piece, ShardState
from weights import read_config
from weights.peft import CONFIG as ADAPTER_CONFIG, adapted_spec
from weights.safetensors_io import CheckpointError, SafetensorsReader

# A leaf's tensor-parallel cut (``tensor_parallel.shard``) is imported where a piece is cut or joined at another
# layout: a run that never meets one (one process, data parallelism) does not load the tensor-parallel engine.
if TYPE_CHECKING:
    from nanotrain.tensor_parallel.shard import TPPlan

MANIFEST = "manifest.json"
FORMAT = "nanotrain-slices-1"


def disk_parts(spec: ModelSpec, moment_bytes: Callable[[str], int]) -> tuple[tuple[str, int], ...]:
    """What a checkpoint of ``spec`` holds on disk, every rank's shards together: the fp32 masters (the weights:
    no model file repeats them) and the moments (``moment_bytes`` of a leaf's path, both of them), of the leaves
    that train (a frozen base is the run's ``--weights``)."""
    trained = [leaf for leaf in spec.leaves if leaf.trainable]
    return (("fp32 masters", sum(4 * prod(leaf.shape) for leaf in trained)),
            ("moments", sum(moment_bytes(leaf.path) for leaf in trained)))


def span(kind: str, start: int, end: int, block: int | None) -> tuple[int, int]:
    """Where entry ``kind`` of a leaf's elements [start, end) lies: those elements, or an absmax's blocks."""
    if not kind.endswith("_absmax"):
        return start, end
    if start % block:
        raise CheckpointError(f"8-bit moments from element {start} are not whole blocks of {block}")
    return start // block, -(-end // block)


class Source(Protocol):
    def scalars(self) -> dict[str, torch.Tensor]: ...

    def read(self, kind: str, piece: Piece, tp: TP, like: torch.Tensor) -> torch.Tensor: ...


def read_entries(state: ShardState, source: Source) -> dict:
    """``state``'s entries (a rank's own: their keys, shapes and dtypes) read from ``source``."""
    by_name, scalars, out = {p.name: p for p in state.pieces}, source.scalars(), {}
    for key, like in state.entries.items():
        if key in SCALARS:
            if key not in scalars:
                raise CheckpointError(f"the checkpoint lacks {key!r}: was it saved by another kind of run?")
            out[key] = scalars[key]
            continue
        kind, _, name = key.partition(".")
        t = source.read(kind, by_name[name], state.tp, like)
        if t.dtype != like.dtype or t.numel() != like.numel():
            raise CheckpointError(f"{kind} of {by_name[name].path} was saved as {t.dtype} x {t.numel()}, this run "
                                  f"holds {like.dtype} x {like.numel()}: saved from another model, or with other "
                                  f"--adam-bits?")
        out[key] = t.view(like.shape)
    return out


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint folder of this format (``--weights`` may name one: its masters load)."""
    return (Path(path) / MANIFEST).is_file()


def read_manifest(ckpt: str | Path) -> dict:
    """The manifest; that of the old one-process layout (``legacy``) read from its files; an old sharded layout
    is refused with how to convert it."""
    ckpt = Path(ckpt)
    path = ckpt / MANIFEST
    manifest = json.loads(path.read_text()) if path.is_file() else None
    if manifest is None and is_old(ckpt):
        manifest = old_manifest(ckpt) | {"format": FORMAT}
    if manifest is None or manifest.get("format") != FORMAT:
        if manifest is None and not (ckpt / "layout.json").is_file():
            raise CheckpointError(f"{ckpt} has no {MANIFEST}: it is no checkpoint, or an incomplete one")
        raise CheckpointError(f"{ckpt} was saved in an older sharded format, which no longer resumes: convert it "
                              f"with `python -m tasks.consolidate {ckpt} --out HF`, then start from it with "
                              f"`--weights HF` (the optimizer state starts afresh)")
    missing = [f for f in manifest["files"] if not (ckpt / f).is_file()]
    if missing:
        raise CheckpointError(f"{ckpt} lacks {', '.join(missing[:3])}: the checkpoint is incomplete; resume from "
                              f"an earlier one")
    return manifest


def check(manifest: dict, ckpt: str | Path, tp_size: int | None, block: int | None) -> None:
    """Refuse 8-bit moments at another tensor-parallel cut or block (``tp_size`` None: whole leaves)."""
    saved = {s["tp"][1] if s["tp"] else None for s in manifest["shards"]}
    if manifest["block"] is not None and (saved != {tp_size} or block not in (None, manifest["block"])):
        what = f"tp {saved.pop()}" if saved != {None} else "whole leaves (no tensor parallelism)"
        raise CheckpointError(f"{ckpt} holds 8-bit moments quantized per leaf as held at {what} in blocks of "
                              f"{manifest['block']}: they resume only with that cut and block; resume so, or with "
                              f"32-bit moments from a run saved with them")


class SliceReader:
    """A checkpoint's pieces, read at any layout (``read_entries``' source); the model from its config."""

    def __init__(self, ckpt: str | Path):
        self.ckpt = Path(ckpt)
        self.manifest = read_manifest(ckpt)
        self.cfg = read_config(ckpt)
        # a LoRA run's: the adapted spec, its pairs the pieces (the base is the run's --weights, frozen)
        self.spec = adapted_spec(ckpt, self.cfg) if (self.ckpt / ADAPTER_CONFIG).is_file() else model_spec(self.cfg)
        self.block = self.manifest["block"]
        self.held: dict[str, list[tuple[str, TP, str, int, int]]] = {}
        for shard in self.manifest["shards"]:
            tp = tuple(shard["tp"]) if shard["tp"] else None
            for name, path, start, end in shard["pieces"]:
                self.held.setdefault(path, []).append((shard["file"], tp, name, start, end))
        self._files: dict[str, SafetensorsReader] = {}
        self._open = ExitStack()

    def __enter__(self) -> "SliceReader":
        return self

    def __exit__(self, *exc) -> None:
        self._open.close()

    def _get(self, file: str, key: str) -> torch.Tensor:
        if file not in self._files:  # opened when first read: a rank reads the files that hold its pieces only
            self._files[file] = self._open.enter_context(SafetensorsReader(self.ckpt / file))
        return self._files[file].get(key)

    def scalars(self) -> dict[str, torch.Tensor]:
        first = self.manifest["files"][0]
        return {k: self._get(first, k) for k in SCALARS if k in self.manifest["scalars"]}

    def read(self, kind: str, piece: Piece, tp: TP, like: torch.Tensor) -> torch.Tensor:
        """Entry ``kind`` of ``piece`` of a leaf cut as ``tp`` says."""
        held = self._held(piece.path)
        if any(h[1] == tp for h in held):
            return self._assemble(kind, piece.path, [h for h in held if h[1] == tp], piece.start, piece.stop)
        if like.dtype == torch.uint8 or kind.endswith("_absmax"):
            check(self.manifest, self.ckpt, tp and tp[1], self.block)
        from nanotrain.tensor_parallel.shard import shard_leaf
        whole = self.whole(kind, piece.path)
        local = whole if tp is None else shard_leaf(piece.path, whole, self._plan(tp))
        return local.reshape(-1)[piece.start:piece.stop]

    def whole(self, kind: str, path: str) -> torch.Tensor:
        """Entry ``kind`` of leaf ``path`` whole, as one process holds it (masters and 32-bit moments)."""
        held, shape = self._held(path), self.spec.shapes[path]
        if any(h[1] is None for h in held):
            return self._assemble(kind, path, [h for h in held if h[1] is None], 0, prod(shape)).view(shape)
        from nanotrain.tensor_parallel.shard import shard_leaf, unshard_leaf
        size = held[0][1][1]
        parts = []
        for t in range(size):
            local = shard_leaf(path, torch.empty(shape, device="meta"), self._plan((t, size))).shape
            parts.append(self._assemble(kind, path, [h for h in held if h[1] == (t, size)], 0, prod(local))
                         .view(local))
        return unshard_leaf(path, parts, self.spec)

    def _held(self, path: str) -> list[tuple[str, TP, str, int, int]]:
        if path not in self.held:
            raise CheckpointError(f"{self.ckpt} holds no {path}: was it saved from another model?")
        return self.held[path]

    def _plan(self, tp: tuple[int, int]) -> TPPlan:
        from nanotrain.tensor_parallel.shard import TPPlan, axis_ranges
        return TPPlan(self.spec, None, False, *axis_ranges(self.spec, tp[1], tp[0]))

    def _assemble(self, kind: str, path: str, held: list, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of entry ``kind`` from the saved pieces ``held`` (one tensor-parallel cut)."""
        lo, hi = span(kind, start, end, self.block)
        whole = [(file, name) for file, _, name, s, e in held if span(kind, s, e, self.block) == (lo, hi)]
        if whole:  # one saved piece is all of it (a process's whole leaf): read, not copied
            return self._get(whole[0][0], f"{kind}.{whole[0][1]}").reshape(-1)
        out, covered = None, torch.zeros(hi - lo, dtype=torch.bool)
        for file, _, name, s, e in held:
            a, b = span(kind, s, e, self.block)
            x, y = max(a, lo), min(b, hi)
            if x < y:
                saved = self._get(file, f"{kind}.{name}").reshape(-1)
                out = torch.empty(hi - lo, dtype=saved.dtype) if out is None else out
                out[x - lo:y - lo] = saved[x - a:y - a]
                covered[x - lo:y - lo] = True
        if out is None or not covered.all():
            raise CheckpointError(f"{self.ckpt} lacks part of {kind} of {path} ({lo}:{hi}): a shard file is "
                                  f"missing or another model's")
        return out
