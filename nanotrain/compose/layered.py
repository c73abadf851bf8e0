"""This tensor-parallel rank's model as a ``LayeredModel``: the pipeline cuts it into stages like the plain one.

``LayeredModel.from_spec`` with ``TPOps`` (``tensor_parallel.ops``) over this rank's shard of the tree
(``shard.shard_leaf``): the names, leaves and costs are the plain model's, so stages split at the same
places for any tp. Between stages flow flat ``[tokens, C]`` activations, or with sequence parallelism
this rank's ``[tokens / tp, C]``: each TP rank of a stage sends its own to the same TP rank of the next
stage. The first stage looks tokens up in its vocabulary slice of the embedding; the last stage's head is
the vocabulary-parallel loss, so a tied embedding's copies on the first and last stage are the same shard
and the pipeline's tied groups (one per pipeline, hence per TP rank) sum their gradients as without TP.

A layer sees only its input; the ops recover ``(batch, seq)`` from the token count and ``seq_len``.
``recompute``: each block (or sublayer) keeps only its input and runs again in backward, its collectives
included, which every rank of its TP group repeats in the same order.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Iterator

import torch

from nanotrain.core.models import run
from nanotrain.core.models.spec import ModelSpec
from nanotrain.pipeline.layered import LayeredModel
from nanotrain.tensor_parallel.ops import TPOps
from nanotrain.tensor_parallel.shard import TPPlan, shard_leaf
from nanotrain.core.leaves import Leaves, Start
from nanotrain.core.tree import named_leaves


def _ops(plan: TPPlan, seq_len: int, x: torch.Tensor) -> TPOps:
    """The ops of the micro-batch whose tokens ``[B, T]``, or whose (token shard of) activations, ``x`` is."""
    if not x.is_floating_point():
        return TPOps(plan, x.shape)
    tokens = x.shape[0] * (plan.grid.tp if plan.sequence_parallel else 1)
    return TPOps(plan, (tokens // seq_len, seq_len))


def _init(plan: TPPlan, weights: Start | None, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The single-process model's values, ``weights`` or else the initial ones (``run.init_stream``), each cut
    to this rank's shard; leaves (``core.leaves``) are read one at a time, so a rank never holds the model whole."""
    if weights is None:
        source = run.init_stream(plan.spec, seed)
    elif isinstance(weights, Leaves):
        source = ((leaf.path, weights.read(leaf.path).float()) for leaf in plan.spec.leaves)
    else:
        source = named_leaves(weights)
    for path, t in source:
        yield path, shard_leaf(path, t, plan)


def _compiled_block(spec: ModelSpec, p: dict, x: torch.Tensor, ops: TPOps, seed: int | None = None) -> torch.Tensor:
    """A whole block compiled between its collectives (``tensor_parallel.ops``, ``plan.compile``), traced with
    dynamo's nested graph breaks on, as ``TPOps.forward`` traces its blocks; its dropout masks drawn from ``seed``
    first, outside the graph."""
    with torch._dynamo.config.patch(nested_graph_breaks=True):
        return ops.block_fn()(p, x, seed, 0, ops)


def tp_layered(plan: TPPlan, seq_len: int, sublayers: bool = False, recompute: bool = False,
               weights: Start | None = None) -> LayeredModel:
    """This TP rank's model as layers (see the module docstring), initialised from the whole model's ``weights``
    when given; dropout follows the seed each micro-batch is given (``Parallel3DTrainer.step``)."""
    block = _compiled_block if plan.compile is not None else run.block
    base = LayeredModel.from_spec(plan.spec, seq_len, sublayers, ops=partial(_ops, plan, seq_len), recompute=recompute,
                                  seeded=True, block=block)  # the trainer hands each micro-batch its dropout seed
    shapes = {path: tuple(shard_leaf(path, torch.empty(shape, device="meta"), plan).shape)
              for path, shape in plan.spec.shapes.items()}
    return replace(base, shapes=shapes, init=partial(_init, plan, weights))
