"""The collectives, the rank grid, and tensor-parallel nn.Sequential (MLP, LayerNorm, BatchNorm,
Dropout, CNN) against the single-process model, on CPU with gloo in spawned ranks.

Tolerances as in test_tp_gpt2: 1e-6 relative per tensor, 1e-5 on losses over several steps.
"""
from __future__ import annotations

import copy
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn

from nanotrain.tensor_parallel import (all_gather_reduce_scatter, all_gather_split, all_reduce_copy, copy_all_reduce,
                                       reduce_scatter_all_gather)
from tasks.demos.tp_sequential import parallelize_sequential
from nanotrain.distributed import GridConfig, build_grid, run_in_group, spawn
from tests.conftest import rel_err
from tests.tensor_parallel.test_tp_gpt2 import count_collectives

TOL, STEP_TOL = 1e-6, 1e-5


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


def assert_modules_close(got: nn.Module, expected: nn.Module, what: str, grads: bool = False) -> None:
    for (name, p), (_, e) in zip(got.named_parameters(), expected.named_parameters()):
        err = rel_err(p.grad if grads else p, e)
        assert err < TOL, f"{what}: {'gradient of ' if grads else ''}{name} off by {err:.2e}"
    for (name, b), (_, e) in zip(got.named_buffers(), expected.named_buffers()):
        if b.is_floating_point():
            assert rel_err(b, e) < TOL, f"{what}: buffer {name} off by {rel_err(b, e):.2e}"


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
    """Outputs, loss and gradients of one step, then losses over AdamW steps, then eval outputs."""
    torch.manual_seed(0)
    ref = make()
    tp = parallelize_sequential(ref, group)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(x_shape, generator=g) for _ in range(steps)]
    out_shape = copy.deepcopy(ref).eval()(xs[0]).shape  # a copy: a train-mode call would move BatchNorm's stats
    targets = [torch.randn(out_shape, generator=g) for _ in range(steps)]
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_tp = torch.optim.AdamW(tp.parameters(), lr=1e-2)
    for i in range(steps):
        torch.manual_seed(100 + i)  # the same dropout masks on every rank and in the reference
        out_ref = ref(xs[i])
        loss_ref = ((out_ref - targets[i]) ** 2).mean()
        torch.manual_seed(100 + i)
        out = tp(xs[i])
        loss = ((out - targets[i]) ** 2).mean()
        opt_ref.zero_grad()
        opt_tp.zero_grad()
        loss_ref.backward()
        loss.backward()
        if i == 0:
            assert rel_err(out, out_ref) < TOL, f"{what}: outputs off by {rel_err(out, out_ref):.2e}"
            assert rel_err(loss, loss_ref) < TOL, f"{what}: loss {loss.item()} != {loss_ref.item()}"
            assert_modules_close(tp, parallelize_sequential(with_grads_as_params(ref), group), what, grads=True)
        assert abs(loss.item() - loss_ref.item()) / loss_ref.item() < STEP_TOL, f"{what}: step {i} loss differs"
        opt_ref.step()
        opt_tp.step()
    assert_modules_close(tp, parallelize_sequential(ref, group), f"{what} after {steps} steps")
    ref.eval()
    tp.eval()
    with torch.no_grad():
        assert rel_err(tp(xs[0]), ref(xs[0])) < TOL, f"{what}: eval outputs differ"


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
