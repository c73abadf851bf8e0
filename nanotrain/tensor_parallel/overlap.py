"""Tensor parallelism's collectives overlapped with the matmuls around them.

With sequence parallelism a column/row pair all-gathers the token shards before its column-parallel
matmul and reduce-scatters the partial sums after its row-parallel one (``layers``); done whole, the
matmul waits for the collective. Both decompose by token chunk, one chunk per rank (the "collective
matmul" of Wang et al. 2023, "Overlap communication with dependent computation via decomposition"):

* ``all_gather_linear`` (a column-parallel layer): tp steps. At step s rank r multiplies the shard of
  rank r - s while sending that shard on to rank r + 1 and receiving the shard of rank r - s - 1 from
  rank r - 1. The shards land in one ``[tokens, in]`` buffer, kept for the weight gradient.
* ``linear_reduce_scatter`` (a row-parallel layer): tp steps. At step s rank r computes its partial
  product for the tokens of rank r - s - 1 while the running sum of the previous step travels, adds
  the running sum received from rank r - 1 and sends the result to rank r + 1; after tp steps each
  rank holds the total of its own tokens.

Each is the other's backward: the column layer's input gradient is a matmul-reduce-scatter, the row
layer's an all-gather-matmul. The column layer's weight gradient (one matmul over all tokens) is
issued while its input gradient's first ring step travels. A step's send and receive go together
through ``batch_isend_irecv`` (NCCL groups them, so a ring of sends cannot deadlock) and run on the
communication stream while the compute stream multiplies. No NVLink multicast, no symmetric memory.

Without sequence parallelism the pair's two all-reduces overlap as chunked asynchronous collectives
(Megatron's asynchronous gradient all-reduce, and its forward counterpart):

* ``copy_all_reduce_linear`` (a column-parallel layer, Megatron's f fused with its matmul): in
  backward the input gradient's all-reduce travels while the weight gradient is computed.
* ``linear_all_reduce_copy`` (a row-parallel layer, g fused): the tokens in ``CHUNKS`` row blocks,
  each block's all-reduce travelling while the next block's matmul computes.

Exactness: the same products as the whole collectives; the ring sums in ring order instead of the
library's, so fp32 results differ by rounding only (the tests hold them to 1e-6 against one
process); the all-reduce versions sum exactly as the unfused ones. Inputs, weights and biases arrive
in the compute dtype (``layers.autocast_inputs``), so everything here runs in one dtype, with or
without autocast. The weight gradients are computed here, to overlap them, so these refuse a
zero-bubble pipeline's deferred weight gradients (``nanotrain.core.linear``). Like ``comms``, the four
public functions are ``torch.compiler.disable``d: a compiled block's graph breaks at each (``ops``).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanotrain.distributed.collectives import Group
from nanotrain.core.linear import deferred_to, linear
from nanotrain.tensor_parallel.comms import (all_gather_reduce_scatter, all_reduce_copy, copy_all_reduce, group_size,
                                             reduce_scatter_all_gather)

CHUNKS = 2  # row blocks of the row-parallel all-reduce: the first block's matmul and the last one's sum stay exposed


class _Ring:
    """This rank's neighbours in ``group``: ``shift`` sends to the next one and receives from the previous one."""

    def __init__(self, group: Group) -> None:
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, send: torch.Tensor, recv: torch.Tensor) -> list:
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group),
                                       dist.P2POp(dist.irecv, recv, self.prev, self.group)])


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _gather_matmul(ring: _Ring, x: torch.Tensor, right: torch.Tensor,
                   bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(all tokens' ``x @ right + bias``, all tokens' ``x``) from this rank's token shard ``x``."""
    n = x.shape[0]
    full = x.new_empty((ring.size * n, x.shape[1]))
    out = x.new_empty((ring.size * n, right.shape[1]))
    full[ring.rank * n:(ring.rank + 1) * n].copy_(x)
    for s in range(ring.size):
        src = (ring.rank - s) % ring.size  # whose shard is here now; the previous rank's arrives next
        here, nxt = slice(src * n, (src + 1) * n), slice((src - 1) % ring.size * n, ((src - 1) % ring.size + 1) * n)
        works = ring.shift(full[here], full[nxt]) if s < ring.size - 1 else []
        if bias is None:
            torch.mm(full[here], right, out=out[here])
        else:
            torch.addmm(bias, full[here], right, out=out[here])
        _wait(works)
    return out, full


def _matmul_scatter(ring: _Ring, h: torch.Tensor, right: torch.Tensor,
                    meanwhile: Callable[[], None] | None = None) -> torch.Tensor:
    """This rank's token chunk of the sum over ranks of ``h @ right`` (``h``: all tokens); ``meanwhile``
    runs once the first step's running sum is on its way."""
    if h.shape[0] % ring.size:
        raise ValueError(f"cannot reduce-scatter {h.shape[0]} tokens over {ring.size} ranks; "
                         f"make batch * sequence length a multiple of {ring.size}")
    n = h.shape[0] // ring.size
    works: list = []
    sending = received = None  # ``sending`` keeps the tensor in flight alive until its send is waited on
    for s in range(ring.size):
        c = (ring.rank - s - 1) % ring.size
        part = h[c * n:(c + 1) * n] @ right  # computes while the previous running sum travels
        _wait(works)
        if received is not None:
            part += received
        if s < ring.size - 1:
            sending, received = part, torch.empty_like(part)
            works = ring.shift(sending, received)
            if s == 0 and meanwhile is not None:
                meanwhile()
    return part


def _refuse_deferral(w: torch.Tensor) -> None:
    if deferred_to() is not None and w.requires_grad and torch.is_grad_enabled():
        raise ValueError("tensor-parallel overlap computes weight gradients in its own backward and cannot defer "
                         "them to a zero-bubble pipeline's W pass; turn overlap off for this schedule")


class _AllGatherLinear(torch.autograd.Function):
    """Forward: all-gather tokens fused with ``x @ w.T + b``. Backward: matmul fused with reduce-scatter."""

    @staticmethod
    def forward(ctx, x, w, b, group):  # type: ignore[override]
        ctx.ring, ctx.has_bias = _Ring(group), b is not None
        y, full = _gather_matmul(ctx.ring, x, w.t(), b)
        ctx.save_for_backward(full, w)
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        full, w = ctx.saved_tensors
        grad = grad.contiguous()
        grads: dict[str, torch.Tensor] = {}

        def weight_grads() -> None:
            if ctx.needs_input_grad[1]:
                grads["w"] = grad.t() @ full
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grads["b"] = grad.sum(0)

        gx = None
        if ctx.needs_input_grad[0]:  # two ranks at least (the wrappers take one rank elsewhere): meanwhile runs
            gx = _matmul_scatter(ctx.ring, grad, w, meanwhile=weight_grads)
        else:
            weight_grads()
        return gx, grads.get("w"), grads.get("b"), None


class _LinearReduceScatter(torch.autograd.Function):
    """Forward: ``h @ w.T`` fused with reduce-scatter of tokens. Backward: all-gather fused with matmul."""

    @staticmethod
    def forward(ctx, h, w, group):  # type: ignore[override]
        ctx.ring = _Ring(group)
        ctx.save_for_backward(h, w)
        return _matmul_scatter(ctx.ring, h, w.t())

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        h, w = ctx.saved_tensors
        gh, full_grad = _gather_matmul(ctx.ring, grad.contiguous(), w)
        gw = full_grad.t() @ h if ctx.needs_input_grad[1] else None
        return (gh if ctx.needs_input_grad[0] else None), gw, None


class _CopyAllReduceLinear(torch.autograd.Function):
    """Forward: ``x @ w.T + b``. Backward: the input gradient's all-reduce under the weight gradient's matmul."""

    @staticmethod
    def forward(ctx, x, w, b, group):  # type: ignore[override]
        ctx.group, ctx.has_bias = group, b is not None
        ctx.save_for_backward(x, w)
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w = ctx.saved_tensors
        grad2 = grad.reshape(-1, grad.shape[-1])
        gx, work = None, None
        if ctx.needs_input_grad[0]:
            gx = grad @ w
            work = dist.all_reduce(gx, group=ctx.group, async_op=True)
        gw = grad2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        gb = grad2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if work is not None:
            work.wait()
        return gx, gw, gb, None


class _LinearAllReduceCopy(torch.autograd.Function):
    """Forward: ``h @ w.T`` summed over ranks, each row block's all-reduce under the next block's matmul.
    Backward: the gradients of a plain linear (the sum's gradient is a copy)."""

    @staticmethod
    def forward(ctx, h, w, group):  # type: ignore[override]
        ctx.save_for_backward(h, w)
        h2 = h.reshape(-1, h.shape[-1])
        y = h2.new_empty((h2.shape[0], w.shape[0]))
        works, n = [], h2.shape[0]
        for i in range(CHUNKS):
            block = slice(i * n // CHUNKS, (i + 1) * n // CHUNKS)
            torch.mm(h2[block], w.t(), out=y[block])
            works.append(dist.all_reduce(y[block], group=group, async_op=True))
        _wait(works)
        return y.view(*h.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        h, w = ctx.saved_tensors
        grad2 = grad.reshape(-1, grad.shape[-1])
        gh = grad @ w if ctx.needs_input_grad[0] else None
        gw = grad2.t() @ h.reshape(-1, h.shape[-1]) if ctx.needs_input_grad[1] else None
        return gh, gw, None


@torch.compiler.disable
def all_gather_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group: Group) -> torch.Tensor:
    """``all_gather(x) @ w.T + b`` for token shards ``x`` [tokens/tp, in], the gather overlapped with the matmul.

    The same as ``linear(all_gather_reduce_scatter(x, group), w, b)``, gradients included.
    """
    if group_size(group) == 1 or x.is_meta:
        return linear(all_gather_reduce_scatter(x, group), w, b)
    _refuse_deferral(w)
    return _AllGatherLinear.apply(x, w, b, group)


@torch.compiler.disable
def linear_reduce_scatter(h: torch.Tensor, w: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's tokens of the sum over ranks of ``h @ w.T``, the reduce-scatter overlapped with the matmul.

    The same as ``reduce_scatter_all_gather(linear(h, w), group)``, gradients included.
    """
    if group_size(group) == 1 or h.is_meta:
        return reduce_scatter_all_gather(linear(h, w), group)
    _refuse_deferral(w)
    return _LinearReduceScatter.apply(h, w, group)


@torch.compiler.disable
def copy_all_reduce_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group: Group) -> torch.Tensor:
    """``x @ w.T + b`` whose input gradient is summed over ``group`` while the weight gradient computes.

    The same as ``linear(copy_all_reduce(x, group), w, b)``, gradients included.
    """
    if group_size(group) == 1 or x.is_meta:
        return linear(copy_all_reduce(x, group), w, b)
    _refuse_deferral(w)
    return _CopyAllReduceLinear.apply(x, w, b, group)


@torch.compiler.disable
def linear_all_reduce_copy(h: torch.Tensor, w: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum over ``group`` of ``h @ w.T``, in ``CHUNKS`` row blocks whose all-reduces overlap the matmul.

    The same as ``all_reduce_copy(linear(h, w), group)``, gradients included.
    """
    if group_size(group) == 1 or h.is_meta:
        return all_reduce_copy(linear(h, w), group)
    _refuse_deferral(w)
    return _LinearAllReduceCopy.apply(h, w, group)
