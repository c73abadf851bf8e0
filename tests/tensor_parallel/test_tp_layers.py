"""The collectives, the rank grid, and tensor-parallel nn.Sequential (MLP, LayerNorm, BatchNorm,
Dropout, CNN) against the single-process model, on CPU with gloo in spawned ranks.

Bounds (fp32), from the computation, so they hold whatever order a CPU's kernels, threads or ranks sum in: the
first step's outputs, loss, gradients and BatchNorm statistics within ``conftest.chain_rtol`` of the reductions
on their path (``sequential_chain``); the weights after the AdamW steps within what AdamW makes of the gradients
each side applied, each later loss within the chain's bound plus what that distance moves it
(``conftest.adam_bounds``); the statistics and eval outputs after the steps, which follow the weights, against
the single-process model run on the TP ranks' own weights (``gathered``), within the chain's bound.
"""
from __future__ import annotations

import copy
import math
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn

from nanotrain.tensor_parallel import (all_gather_reduce_scatter, all_gather_split, all_reduce_copy, copy_all_reduce,
                                       reduce_scatter_all_gather)
from tasks.demos.tp_sequential import parallelize_sequential
from nanotrain.core.optim import AdamConfig
from nanotrain.distributed import GridConfig, build_grid, run_in_group, spawn
from tests.conftest import adam_bounds, chain_rtol, rel_err
from tests.tensor_parallel.test_tp_gpt2 import count_collectives

ADAM = AdamConfig(lr=1e-2, weight_decay=0.01)  # torch.optim.AdamW's defaults but the rate


def check_comms(group) -> None:
    """Each collective's forward and backward against what it must compute."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    xs = [torch.arange(8.0).view(4, 2) * (r + 1) for r in range(size)]  # rank r's input
    gs = [torch.ones(4, 2) * (r + 2) for r in range(size)]              # rank r's output gradient

    def run(fn, grad):
        x = xs[rank].clone().requires_grad_()
        y = fn(x)
        y.backward(grad)
        return y.detach(), x.grad

    y, g = run(lambda x: copy_all_reduce(x, group), gs[rank])
    assert torch.equal(y, xs[rank]) and torch.equal(g, sum(gs)), "copy_all_reduce"
    y, g = run(lambda x: all_reduce_copy(x, group), gs[rank])
    assert torch.equal(y, sum(xs)) and torch.equal(g, gs[rank]), "all_reduce_copy"
    full_g = torch.cat(gs, dim=-1)
    y, g = run(lambda x: all_gather_split(x, group, dim=-1), full_g)
    assert torch.equal(y, torch.cat(xs, dim=-1)) and torch.equal(g, gs[rank]), "all_gather_split"
    big_gs = [torch.cat([gr] * size) for gr in gs]
    y, g = run(lambda x: all_gather_reduce_scatter(x, group), big_gs[rank])
    assert torch.equal(y, torch.cat(xs)) and torch.equal(g, sum(big_gs).chunk(size)[rank]), "all_gather_reduce_scatter"
    y, g = run(lambda x: reduce_scatter_all_gather(x, group), gs[rank][: 4 // size])
    assert torch.equal(y, sum(xs).chunk(size)[rank])
    assert torch.equal(g, torch.cat([gr[: 4 // size] for gr in gs])), "reduce_scatter_all_gather"


def check_single_rank_is_identity(group) -> None:
    x = torch.randn(4, 2)
    for fn in (copy_all_reduce, all_reduce_copy, all_gather_reduce_scatter, reduce_scatter_all_gather):
        assert fn(x, group) is x, f"{fn.__name__} on a one-rank group must return its input"
    assert all_gather_split(x, group) is x


def with_grads_as_params(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are its gradients: parallelize it to get the expected shards."""
    out = copy.deepcopy(model)
    for p, q in zip(model.parameters(), out.parameters()):
        q.data = p.grad.clone()
    return out


def assert_grads_close(got: nn.Module, expected: nn.Module, what: str, rtol: float) -> None:
    for (name, p), (_, e) in zip(got.named_parameters(), expected.named_parameters()):
        err = rel_err(p.grad, e)
        assert err <= rtol, f"{what}: gradient of {name} off by {err:.2e} (bound {rtol:.2e})"


def assert_buffers_close(got: nn.Module, expected: nn.Module, what: str, rtol: float) -> None:
    for (name, b), (_, e) in zip(got.named_buffers(), expected.named_buffers()):
        if b.is_floating_point():
            assert rel_err(b, e) <= rtol, f"{what}: buffer {name} off by {rel_err(b, e):.2e} (bound {rtol:.2e})"


def sequential_chain(model: nn.Sequential, x: torch.Tensor) -> tuple[list[int], list[int]]:
    """The reductions on ``model``'s path on input ``x``, for ``chain_rtol``: forward (a Linear's or Conv2d's
    inner sum, a LayerNorm's or BatchNorm's mean and variance over its features or rows) and backward (each
    layer's input gradient, transposed, and the largest sum over rows a weight's gradient takes)."""
    fwd, bwd, rows = [], [], 1
    with torch.no_grad():
        for layer in copy.deepcopy(model).eval():
            out = layer(x)
            if isinstance(layer, (nn.Linear, nn.Conv2d)):
                k = 1 if isinstance(layer, nn.Linear) else layer.kernel_size[0] * layer.kernel_size[1]
                inner, outer = (layer.in_features, layer.out_features) if k == 1 else (layer.in_channels,
                                                                                       layer.out_channels)
                fwd.append(inner * k)
                bwd.insert(0, outer * k)
                rows = max(rows, out.numel() // outer)
            elif isinstance(layer, (nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d)):
                n = math.prod(layer.normalized_shape) if isinstance(layer, nn.LayerNorm) else x.numel() // x.shape[1]
                fwd += [n, n]
                bwd[:0] = [n, n]
            x = out
    return fwd, [x.numel()] + bwd + [rows]  # the loss's mean over the outputs, then back


def gathered(tp: nn.Module, ref: nn.Module, group) -> torch.Tensor:
    """The TP ranks' parameters put back together, flat in ``ref``'s order: each shard's elements found in the
    whole by parallelizing a copy of ``ref`` whose parameters hold their own places (float64: exact)."""
    places = copy.deepcopy(ref).double()
    start = 0
    for p in places.parameters():
        p.data = torch.arange(start, start + p.numel(), dtype=torch.float64).view_as(p)
        start += p.numel()
    mine = [(i.detach().reshape(-1).long(), p.detach().reshape(-1).clone())
            for i, p in zip(parallelize_sequential(places, group).parameters(), tp.parameters())]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    flat = torch.full((start,), float("nan"))  # an element no rank holds stays NaN: no bound then holds
    for pieces in everyone:
        for i, v in pieces:
            flat[i] = v
    return flat


def mlp(norm: str, dropout: float = 0.0) -> nn.Sequential:
    """30 hidden features, so 4 ranks get 8, 8, 7, 7."""
    if norm == "layer":
        return nn.Sequential(nn.LayerNorm(12), nn.Linear(12, 30), nn.GELU(), nn.Linear(30, 12), nn.LayerNorm(12))
    if norm == "batch":
        # No bias before a BatchNorm: it would cancel, its gradient is zero and only rounding noise is left to compare.
        return nn.Sequential(nn.Linear(12, 30, bias=False), nn.BatchNorm1d(30), nn.ReLU(),
                             nn.Linear(30, 12, bias=False), nn.BatchNorm1d(12))
    return nn.Sequential(nn.Linear(12, 30), nn.ReLU(), nn.Dropout(dropout), nn.Linear(30, 12))


def cnn() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(6 * 4 * 4, 10))


def check_sequential(make, x_shape: tuple[int, ...], group, what: str, steps: int = 3) -> None:
    """Outputs, loss, gradients and statistics of one step, then losses and weights over AdamW steps, then the
    statistics and eval outputs against the single-process model stepped on the TP ranks' weights (``shadow``)."""
    torch.manual_seed(0)
    ref = make()
    tp = parallelize_sequential(ref, group)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(x_shape, generator=g) for _ in range(steps)]
    fwd, bwd = sequential_chain(ref, xs[0])
    # a statistic: the forward's chain, then the running average's two products and sum a step
    out_rtol, stat_rtol = chain_rtol(fwd), chain_rtol(fwd + [1] * 3 * steps)
    loss_rtol, grad_rtol = chain_rtol(fwd + bwd[:1]), chain_rtol(fwd + bwd)
    out_shape = copy.deepcopy(ref).eval()(xs[0]).shape  # a copy: a train-mode call would move BatchNorm's stats
    targets = [torch.randn(out_shape, generator=g) for _ in range(steps)]
    opts = [torch.optim.AdamW(m.parameters(), lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps,
                              weight_decay=ADAM.weight_decay) for m in (ref, tp)]
    start = {name: p.detach().clone() for name, p in tp.named_parameters()}
    shadow = copy.deepcopy(ref)
    losses, grads, ref_grads = [], [], []  # each step's; the gradients this rank's shards, by name
    for i in range(steps):
        with torch.no_grad():
            nn.utils.vector_to_parameters(gathered(tp, ref, group), shadow.parameters())
        outs = []
        for model in (ref, tp, shadow):
            torch.manual_seed(100 + i)  # the same dropout masks on every rank and in the reference
            outs.append(model(xs[i]))
        out_ref, out, _ = outs  # the shadow's call moves its statistics, as the TP ranks' weights do
        loss_ref, loss = ((out_ref - targets[i]) ** 2).mean(), ((out - targets[i]) ** 2).mean()
        for opt in opts:
            opt.zero_grad()
        loss_ref.backward()
        loss.backward()
        if i == 0:
            assert rel_err(out, out_ref) <= out_rtol, f"{what}: outputs off by {rel_err(out, out_ref):.2e}"
            expected = parallelize_sequential(with_grads_as_params(ref), group)
            assert_grads_close(tp, expected, what, grad_rtol)
            assert_buffers_close(tp, expected, what, stat_rtol)
        losses.append((loss.item(), loss_ref.item()))
        grads.append({name: p.grad.clone() for name, p in tp.named_parameters()})
        ref_grads.append(dict(parallelize_sequential(with_grads_as_params(ref), group).named_parameters()))
        for opt in opts:
            opt.step()
    aparts, moved = adam_bounds(start, grads, ref_grads, ADAM)
    moved = torch.tensor(moved, dtype=torch.float64)
    dist.all_reduce(moved, group=group)  # the loss moves with every rank's shards (replicas counted again)
    for s, (a, b) in enumerate(losses):
        assert abs(a - b) <= loss_rtol * abs(b) + moved[s], f"{what}: step {s} loss {a} != {b}"
    for (name, p), (_, e) in zip(tp.named_parameters(), parallelize_sequential(ref, group).named_parameters()):
        over = ((p.detach() - e.detach()).abs().reshape(-1) / aparts[name][-1]).max()
        assert over <= 1, f"{what}: {name} after {steps} steps {over:.2f} times its bound"
    with torch.no_grad():
        nn.utils.vector_to_parameters(gathered(tp, ref, group), shadow.parameters())
    assert_buffers_close(tp, parallelize_sequential(shadow, group), f"{what} after {steps} steps", stat_rtol)
    tp.eval()
    shadow.eval()
    with torch.no_grad():  # the statistics' chain, then the forward's again
        err, bound = rel_err(tp(xs[0]), shadow(xs[0])), chain_rtol(fwd + [1] * 3 * steps + fwd)
        assert err <= bound, f"{what}: eval outputs {err:.2e} apart (bound {bound:.2e})"


def check_all_sequentials(group) -> None:
    check_sequential(lambda: mlp("none"), (16, 12), group, "linear-relu-linear")
    check_sequential(lambda: mlp("layer"), (16, 12), group, "with LayerNorm")
    check_sequential(lambda: mlp("batch"), (16, 12), group, "with BatchNorm (train, then eval)")
    check_sequential(lambda: mlp("none", dropout=0.3), (16, 12), group, "with Dropout")
    check_sequential(cnn, (4, 3, 8, 8), group, "CNN with BatchNorm2d")


def check_mlp_collectives(group) -> None:
    torch.manual_seed(0)
    tp = parallelize_sequential(mlp("none"), group)
    x = torch.randn(16, 12, requires_grad=True)  # else backward has no input gradient to reduce
    with count_collectives() as fwd:
        y = tp(x)
    with count_collectives() as bwd:
        y.sum().backward()
    assert fwd == Counter(all_reduce=1), f"column+row MLP forward ran {dict(fwd)}, expected one all-reduce"
    assert bwd == Counter(all_reduce=1), f"column+row MLP backward ran {dict(bwd)}, expected one all-reduce"
    layers = [type(m).__name__ for m in tp]
    assert layers == ["CopyAllReduce", "Linear", "ReLU", "ShardedDropout", "Linear", "AllReduceAddBias"], layers


def _world2(rank: int, world: int) -> None:
    grid = build_grid(GridConfig(tp=2))
    check_comms(grid.tp_group)
    check_mlp_collectives(grid.tp_group)
    check_all_sequentials(grid.tp_group)


def _world4(rank: int, world: int) -> None:
    grid = build_grid(GridConfig(tp=4))
    check_comms(grid.tp_group)
    check_all_sequentials(grid.tp_group)
    grid = build_grid(GridConfig(tp=1, dp=2, pp=2))
    assert (grid.dp_rank, grid.pp_rank) == (rank % 2, rank // 2), "grid coordinates: tp innermost, pp outermost"
    check_single_rank_is_identity(grid.tp_group)
    sub = build_grid(GridConfig(tp=2), ranks=[2, 3])
    assert (sub is None) == (rank < 2) and (sub is None or sub.tp_rank == rank - 2), "grid over a subset of ranks"


def test_collectives_and_sequential_tp2():
    spawn(run_in_group, 2, ("gloo", _world2), timeout_s=120, start_method="fork")


def test_collectives_and_sequential_tp4_and_grid():
    spawn(run_in_group, 4, ("gloo", _world4), timeout_s=120, start_method="fork")
