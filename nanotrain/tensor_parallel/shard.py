"""How a model's parameter tree is cut over a tensor-parallel group: by each leaf's ``Placement`` in its spec.

A placement names the dim a leaf is split along and the segments it is the concatenation of, each
``(axis, rows)``: ``rows`` consecutive rows per element of the axis (``models.spec``). The plan gives this
rank a range of every axis, and a rank keeps, of each segment, the rows of its elements:

* key/value heads are partitioned over the ranks; they need not divide evenly (gpt2-xl's 25 heads go
  13/12 on 2 ranks). Query heads follow their key/value head: with grouped-query attention each
  key/value head serves ``g = heads / kv_heads`` consecutive query heads, and a rank keeps those
  groups whole, so its attention needs no other rank's keys. A fused q/k/v matrix keeps its rows of q,
  of k and of v; the output projection the matching columns.
* more ranks than key/value heads (Megatron's replication): tp a multiple of the key/value heads, each
  held by ``r = tp / kv_heads`` consecutive ranks, which split its group of query heads. Each of them
  computes the head's keys and values whole, but their gradients only from its own query heads: those
  rows' gradients are summed over the ``r`` ranks (``kv_group``, built once with the plan; ``grads``), a
  norm counts them once (on the first of the ``r``: ``counted_pieces``) and unsharding takes one copy.
* neurons: the MLP's hidden neurons (of each half of a fused gate|up matrix, and the down projection's
  matching columns).
* vocabulary: padded with zero rows to a multiple of ``tp * vocab_multiple`` and split evenly: equal
  shards let logits be all-gathered, and each shard's GEMM is a multiple of ``vocab_multiple`` wide
  (``nanotrain.core.loss.VOCAB_ALIGN``: 50257 columns push cuBLAS onto slow kernels). Padding rows are never
  looked up (token ids are checked against the real vocabulary) and their logits are masked to -inf in
  the loss, so they change neither the loss nor any gradient; their own gradient is zero and AdamW keeps
  them at zero.

Replicated leaves (norms, the row-parallel biases added after the reduction, a position table) are whole
on every rank. Shards are copies, so the whole tree can be freed once every rank has its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from nanotrain.distributed.collectives import Group
from nanotrain.distributed.grid import RankGrid
from nanotrain.core.loss import VOCAB_ALIGN
from nanotrain.core.models.registry import model_spec
from nanotrain.core.models.run import tree_from
from nanotrain.core.models.spec import KV_HEADS, NEURONS, Q_HEADS, VOCAB, ModelSpec
from nanotrain.core.tree import Tree, named_leaves


def partition(n: int, parts: int, index: int) -> range:
    """Part ``index`` of ``range(n)`` cut into ``parts`` contiguous pieces differing by at most one."""
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return range(lo, lo + base + (index < extra))


def padded_vocab(vocab_size: int, tp: int) -> int:
    step = tp * VOCAB_ALIGN
    return -(-vocab_size // step) * step


@dataclass(frozen=True)
class TPPlan:
    """Which slice of the model this rank holds, and how its activations move. ``grid`` may be None where
    only tensors are cut (no collective runs)."""
    spec: ModelSpec
    grid: RankGrid | None
    sequence_parallel: bool
    q_heads: range       # this rank's query heads
    kv_heads: range      # ... key/value heads (their groups of query heads are ``q_heads``)
    neurons: range       # ... MLP hidden neurons
    vocab: range         # ... rows of the padded vocabulary
    padded_vocab: int
    overlap: bool = False  # collectives overlapped with the matmuls (``overlap``)
    compile: Any = None    # a torch.compile backend, e.g. "inductor": blocks compiled between the collectives (``ops``)
    kv_group: Group | None = None  # the ranks holding this rank's key/value head, when tp exceeds those heads

    def range_of(self, axis: str) -> range:
        return {Q_HEADS: self.q_heads, KV_HEADS: self.kv_heads, NEURONS: self.neurons, VOCAB: self.vocab}[axis]


def tp_sizes(spec: ModelSpec) -> list[int]:
    """Every tp the model can be cut over: at most its key/value heads (split), or a multiple of them up to its query
    heads (each key/value head replicated over tp / kv_heads ranks, each with a query head at least)."""
    heads, kv_heads, _ = spec.heads
    return [t for t in range(1, heads + 1) if t <= kv_heads or t % kv_heads == 0]


def kv_replicas(spec: ModelSpec, tp: int) -> int:
    """Ranks holding each key/value head: 1 when ``tp`` is at most the key/value heads (they are split), else
    ``tp / kv_heads`` (replicated); a ``tp`` not in ``tp_sizes`` is refused, naming those that work."""
    heads, kv_heads, _ = spec.heads
    if tp not in tp_sizes(spec):
        raise ValueError(f"tp={tp} neither splits the model's {kv_heads} key/value heads nor replicates each over "
                         f"the same number of ranks with a query head each ({heads} query heads); use tp in "
                         f"{', '.join(map(str, tp_sizes(spec)))}")
    return max(1, tp // kv_heads)


def axis_ranges(spec: ModelSpec, tp: int, rank: int) -> tuple[range, range, range, range, int]:
    """Rank ``rank``'s (query heads, key/value heads, neurons, vocabulary rows) of ``tp``, and the padded vocabulary."""
    heads, kv_heads, _ = spec.heads
    group, replicas = heads // kv_heads, kv_replicas(spec, tp)
    vocab = padded_vocab(spec.vocab_size, tp)
    if replicas == 1:
        kv = partition(kv_heads, tp, rank)
        q = range(kv.start * group, kv.stop * group)
    else:  # one key/value head, its group of query heads split over the ranks sharing it
        head, mine = rank // replicas, partition(group, replicas, rank % replicas)
        kv, q = range(head, head + 1), range(head * group + mine.start, head * group + mine.stop)
    return q, kv, partition(spec.mlp_width, tp, rank), partition(vocab, tp, rank), vocab


def kv_group(spec: ModelSpec, grid: RankGrid) -> Group | None:
    """The process group of the ranks sharing this rank's key/value head (None: none are shared, or ``grid`` has no
    process groups). Only its members create it, the same ranks in the same order on each."""
    replicas = kv_replicas(spec, grid.tp)
    if replicas == 1 or grid.tp_group is None:
        return None
    first = grid.tp_rank - grid.tp_rank % replicas
    members = [grid.global_rank(tp=t) for t in range(first, first + replicas)]
    return dist.new_group(members, timeout=grid.timeout, use_local_synchronization=True)


def plan_tp(model: Any, grid: RankGrid, sequence_parallel: bool = False, overlap: bool = False,
            compile: Any = None) -> TPPlan:
    """This rank's plan on ``grid``'s tensor-parallel group, for any family's config (or spec). Collective over the
    ranks sharing a key/value head when tp exceeds those heads (it builds their group)."""
    spec = model_spec(model)
    return TPPlan(spec, grid, sequence_parallel, *axis_ranges(spec, grid.tp, grid.tp_rank),
                  overlap=overlap, compile=compile, kv_group=kv_group(spec, grid))


def token_range(n_tokens: int, plan: TPPlan) -> range:
    """This rank's tokens of the flat ``[B*T, C]`` activations: all of them, or its share with sequence parallelism."""
    if not plan.sequence_parallel:
        return range(n_tokens)
    tp = plan.grid.tp
    if n_tokens % tp:
        raise ValueError(f"sequence parallelism splits the {n_tokens} tokens of a batch over tp={tp} ranks; "
                         f"make batch * sequence length a multiple of {tp}")
    share = n_tokens // tp
    return range(plan.grid.tp_rank * share, (plan.grid.tp_rank + 1) * share)


def _segments(path: str, t: torch.Tensor, spec: ModelSpec) -> list[tuple[torch.Tensor, str, int]]:
    """The leaf's segments along its placement's dim, each with its axis and rows per element."""
    leaf = spec.leaf(path)
    placement, sizes = leaf.placement, spec.segment_rows(leaf)
    if sum(sizes) != t.shape[placement.dim]:
        raise ValueError(f"{path} has {t.shape[placement.dim]} rows along dim {placement.dim} but its placement "
                         f"{placement.segments} makes {sum(sizes)}; build the plan from the model the tree came from")
    parts = t.split(sizes, placement.dim)
    return [(part, axis, rows) for part, (axis, rows) in zip(parts, placement.segments, strict=True)]


def shard_leaf(path: str, t: torch.Tensor, plan: TPPlan) -> torch.Tensor:
    """This rank's slice of the leaf at ``path``, a fresh copy."""
    placement = plan.spec.leaf(path).placement
    if placement.replicated:
        return t.clone()
    dim, parts = placement.dim, []
    for part, axis, rows in _segments(path, t, plan.spec):
        if axis == VOCAB:  # zero rows up to the padded vocabulary
            shape = list(part.shape)
            shape[dim] = (plan.padded_vocab - plan.spec.vocab_size) * rows
            part = torch.cat([part, part.new_zeros(shape)], dim)
        mine = plan.range_of(axis)
        parts.append(part.narrow(dim, mine.start * rows, len(mine) * rows))
    return torch.cat(parts, dim)


def unshard_leaf(path: str, shards: Sequence[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """The whole leaf from its shards in TP-rank order: ``shard_leaf``'s inverse (padding rows dropped)."""
    placement = spec.leaf(path).placement
    if placement.replicated:
        return shards[0]
    plans = [TPPlan(spec, None, False, *axis_ranges(spec, len(shards), r)) for r in range(len(shards))]
    pieces = [local_segments(path, s, plans[r]) for r, s in enumerate(shards)]
    whole = []
    for j, (axis, rows) in enumerate(placement.segments):
        # a replicated key/value head: the same range on consecutive ranks, one copy taken
        part = torch.cat([p[j][0] for r, p in enumerate(pieces)
                          if r == 0 or plans[r].range_of(axis) != plans[r - 1].range_of(axis)], placement.dim)
        whole.append(part.narrow(placement.dim, 0, spec.vocab_size * rows) if axis == VOCAB else part)
    return torch.cat(whole, placement.dim)


def shard_params(params: Tree, plan: TPPlan) -> Tree:
    """This rank's tree, same paths as the model's, each tensor a fresh copy of its slice.

    Applied to a tree of full gradients it gives the gradients each rank must have (that is how the tests
    check exactness).
    """
    shapes, leaves = plan.spec.shapes, dict(named_leaves(params))
    wrong = [p for p in shapes if p not in leaves or tuple(leaves[p].shape) != shapes[p]]
    wrong += sorted(set(leaves) - set(shapes))
    if wrong:
        got = tuple(leaves[wrong[0]].shape) if wrong[0] in leaves else "missing"
        raise ValueError(f"params do not match the plan's model: {wrong[0]} is {got}, the model's "
                         f"{shapes.get(wrong[0], 'absent')}; build the plan from the config the params came from")
    return tree_from(plan.spec, ((path, shard_leaf(path, t, plan)) for path, t in leaves.items()))


def summed(path: str, plan: TPPlan) -> bool:
    """Whether each rank holds only a part of the gradient of the whole leaf at ``path``, to be summed over TP.

    A replicated leaf applied to the residual stream (a norm, a row-parallel bias, a position table) sees
    this rank's tokens alone with sequence parallelism, so its gradient is a partial sum; without it every
    rank applies it to every token and its gradient is already whole (summing would multiply it by tp). A
    leaf applied inside a parallel region (``Placement.in_region``: Qwen3's per-head q and k norms) sees this
    rank's heads only: its gradient is partial either way.
    """
    placement = plan.spec.leaf(path).placement
    return placement.replicated and (plan.sequence_parallel or placement.in_region)


def replicated_leaves(local: Tree, spec: ModelSpec) -> list[torch.Tensor]:
    """The tensors every rank holds whole, in tree order (the same on every rank of the TP group).

    ``local`` may be a pipeline stage's part of the tree: leaves it lacks (None, or absent from a block) are
    skipped, and the ranks of a TP group hold the same stages, so the same leaves.
    """
    return [t for path, t in named_leaves(local)
            if isinstance(t, torch.Tensor) and spec.leaf(path).placement.replicated]


def local_segments(path: str, t: torch.Tensor, plan: TPPlan) -> list[tuple[torch.Tensor, str]]:
    """Views of ``t``, this rank's shard of the split leaf at ``path`` (or its gradient), one per segment of its
    placement, each with its axis."""
    placement = plan.spec.leaf(path).placement
    parts = t.split([len(plan.range_of(axis)) * rows for axis, rows in placement.segments], placement.dim)
    return [(part, axis) for part, (axis, _) in zip(parts, placement.segments, strict=True)]


def kv_pieces(path: str, t: torch.Tensor, plan: TPPlan) -> list[torch.Tensor]:
    """The key/value rows of ``t``, this rank's shard of the leaf at ``path`` (or its gradient), as views."""
    if plan.spec.leaf(path).placement.replicated:
        return []
    return [part for part, axis in local_segments(path, t, plan) if axis == KV_HEADS]


def counted_pieces(path: str, t: torch.Tensor, plan: TPPlan) -> list[torch.Tensor]:
    """``t``, this rank's shard of a split leaf (or its gradient), less the key/value rows another rank of the TP
    group counts: what a sum over the group takes from this rank to count every element once. The first of the
    ranks sharing a key/value head counts its rows (every rank when none are shared)."""
    if plan.grid.tp_rank % kv_replicas(plan.spec, plan.grid.tp) == 0:
        return [t]
    return [part for part, axis in local_segments(path, t, plan) if axis != KV_HEADS]
