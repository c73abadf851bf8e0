"""Column- and row-parallel linear layers as functions of (input, local weight shard).

A column-parallel layer holds a slice of the output neurons (rows of the ``[out, in]`` weight);
a row-parallel layer holds the matching slice of the input neurons (columns) and sums the partial
outputs. Run back to back with an elementwise function between them, the pair needs a single
all-reduce in forward (in ``row_linear``) and a single one in backward (in ``column_linear``):

    y = row_linear(gelu(column_linear(x, w1, b1, group)), w2, b2, group)

With sequence parallelism the input arrives as this rank's shard of the tokens; the pair then
all-gathers tokens on the way in and reduce-scatters them on the way out, moving the same bytes
as the all-reduce while the parts outside the pair run on 1/tp of the tokens.

Both go through ``nanotrain.core.linear.linear``, so a zero-bubble pipeline defers their weight
gradients to its W pass as it does the plain model's. With ``overlap`` the collectives travel
while matmuls compute instead (``overlap``: ring steps with sequence parallelism, chunked or
asynchronous all-reduces without), the weight gradients computed in place.

Under autocast the input is cast to the compute dtype *before* it enters the parallel region: the
GEMM would cast it anyway, so the forward is unchanged, but the all-gather (sequence parallel) and
the input gradient's all-reduce or reduce-scatter then move bf16 instead of fp32: half the bytes.
The gradient sum is rounded to bf16 once, as the row-parallel output's sum already was.
"""
from __future__ import annotations

import torch

from nanotrain.distributed.collectives import Group
from nanotrain.core.linear import linear
from nanotrain.tensor_parallel.comms import (all_gather_reduce_scatter, all_reduce_copy, copy_all_reduce,
                                             group_size, reduce_scatter_all_gather)
from nanotrain.tensor_parallel.overlap import (all_gather_linear, copy_all_reduce_linear, linear_all_reduce_copy,
                                               linear_reduce_scatter)


def autocast_inputs(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The tensors cast as ``F.linear`` under the active autocast would cast them (unchanged without autocast)."""
    kind = next(t for t in tensors if t is not None).device.type
    if not (torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)):
        return tensors
    dtype = torch.get_autocast_dtype(kind)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in tensors)


def enter_parallel(x: torch.Tensor, group: Group, sequence_parallel: bool = False) -> torch.Tensor:
    """The input every rank needs whole before computing its part of the neurons."""
    return all_gather_reduce_scatter(x, group) if sequence_parallel else copy_all_reduce(x, group)


def leave_parallel(partial: torch.Tensor, group: Group, sequence_parallel: bool = False) -> torch.Tensor:
    """Sum the ranks' partial outputs (into this rank's token shard with sequence parallelism)."""
    return reduce_scatter_all_gather(partial, group) if sequence_parallel else all_reduce_copy(partial, group)


def column_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group: Group,
                  sequence_parallel: bool = False, overlap: bool = False) -> torch.Tensor:
    """``x @ w.T + b`` for this rank's output neurons: ``w`` is ``[out/tp, in]``, the result stays sharded."""
    if group_size(group) == 1:
        return linear(x, w, b)
    if overlap:
        return (all_gather_linear if sequence_parallel else copy_all_reduce_linear)(*autocast_inputs(x, w, b), group)
    (x,) = autocast_inputs(x)
    return linear(enter_parallel(x, group, sequence_parallel), w, b)


def row_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group: Group,
               sequence_parallel: bool = False, overlap: bool = False) -> torch.Tensor:
    """Input sharded by neurons, ``w`` is ``[out, in/tp]``; the output is whole (or this rank's tokens).

    The bias is added once, after the reduction: added before it, it would be counted tp times.
    With one rank there is no reduction, and the bias rides in the GEMM's epilogue instead.
    """
    if group_size(group) == 1:
        return linear(x, w, b)
    if overlap:
        y = (linear_reduce_scatter if sequence_parallel else linear_all_reduce_copy)(*autocast_inputs(x, w), group)
    else:
        y = leave_parallel(linear(x, w), group, sequence_parallel)
    return y if b is None else y + b
