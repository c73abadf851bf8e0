"""Uneven head splits, collective matmul (``--tp-overlap``) and the collectives of one tensor-parallel
step, against the single-process model, on CPU with gloo in spawned ranks.

The model has 5 heads: 3/2 on two ranks, 2/2/1 on three (gpt2-xl's 25 go 13/12), and 160 MLP
neurons (80/80, 54/53/53). Sequences of 24 tokens, so a batch of 48 splits over 2 and 3 ranks.
Tolerances as in test_tp_gpt2: 1e-6 relative per tensor in fp32.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from nanotrain.core import models
from nanotrain.core.models import model_spec, preset
from nanotrain.core.models.spec import Q_HEADS
from nanotrain.distributed import run_in_group, spawn
from nanotrain.distributed.grid import GridConfig, RankGrid, build_grid
from nanotrain.core.linear import deferring_weight_grads, linear
from nanotrain.tensor_parallel import parallel_loss, plan_tp, shard_params, sync_grads
from nanotrain.tensor_parallel.comms import (all_gather_reduce_scatter, all_reduce_copy, copy_all_reduce,
                                             reduce_scatter_all_gather)
from nanotrain.tensor_parallel.overlap import (CHUNKS, all_gather_linear, copy_all_reduce_linear,
                                               linear_all_reduce_copy, linear_reduce_scatter)
from nanotrain.tensor_parallel.shard import TPPlan, shard_leaf, unshard_leaf
from nanotrain.core.tree import named_leaves, tree_map
from tests.conftest import chain_rtol, rel_err
from tests.tensor_parallel.test_tp_gpt2 import (DROPOUT, batch, check_exact, check_training, count_collectives,
                                 leaves_requiring_grad)

CFG = preset("tiny", n_layer=2, n_embd=40, n_head=5, vocab_size=251, n_ctx=32)
T = 24
MODES = ((False, False), (False, True), (True, False), (True, True))  # (sequence parallel, overlap)


def check_overlapped_ops(group) -> None:
    """Each overlapped op equals the whole collective around a linear, backward too, with a different
    number of output (column) or input (row) features on each rank."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(rank)
    n, c, m = 4, 6, 5 + rank
    w_col, b_col, w_row = torch.randn(m, c, generator=g), torch.randn(m, generator=g), torch.randn(c, m, generator=g)
    x, x_all = torch.randn(n, c, generator=g), torch.randn(size * n, c, generator=g)  # a token shard, all tokens
    h = torch.randn(size * n, m, generator=g)
    grad_col, grad_row = torch.randn(size * n, m, generator=g), torch.randn(n, c, generator=g)

    def run(fn, inputs, grad, need_x=True):
        leaves = [t.clone().requires_grad_(need_x or i > 0) if t is not None else None for i, t in enumerate(inputs)]
        y = fn(*leaves)
        y.backward(grad)
        return [y.detach()] + [t.grad for t in leaves if t is not None and t.requires_grad]

    rtol = chain_rtol([c, 5 + size, size * n, size])  # the matmuls' features, the tokens, the ranks' sum

    def compare(name, got, ref):
        for i, (a, e) in enumerate(zip(got, ref)):
            assert rel_err(a, e) < rtol, f"{name} output/grad {i} off by {rel_err(a, e):.2e}"

    for bias in (b_col, None):
        for need_x in (True, False):
            compare("all_gather_linear", run(lambda a, w, b: all_gather_linear(a, w, b, group), (x, w_col, bias),
                                             grad_col, need_x),
                    run(lambda a, w, b: linear(all_gather_reduce_scatter(a, group), w, b), (x, w_col, bias), grad_col,
                        need_x))
            compare("copy_all_reduce_linear", run(lambda a, w, b: copy_all_reduce_linear(a, w, b, group),
                                                  (x_all, w_col, bias), grad_col, need_x),
                    run(lambda a, w, b: linear(copy_all_reduce(a, group), w, b), (x_all, w_col, bias), grad_col,
                        need_x))
    compare("linear_reduce_scatter", run(lambda a, w: linear_reduce_scatter(a, w, group), (h, w_row), grad_row),
            run(lambda a, w: reduce_scatter_all_gather(linear(a, w), group), (h, w_row), grad_row))
    full_grad = torch.cat([grad_row] * size)
    compare("linear_all_reduce_copy", run(lambda a, w: linear_all_reduce_copy(a, w, group), (h, w_row), full_grad),
            run(lambda a, w: all_reduce_copy(linear(a, w), group), (h, w_row), full_grad))
    meta = [t.to("meta") for t in (x, w_col, h, w_row)]  # a pipeline's shape pass sends nothing
    assert all_gather_linear(meta[0], meta[1], None, group).shape == (size * n, m)
    assert linear_reduce_scatter(meta[2], meta[3], group).shape == (n, c)
    with deferring_weight_grads([]):  # a zero-bubble W pass would never see these weight gradients
        with pytest.raises(ValueError, match="turn overlap off"):
            all_gather_linear(x, w_col.clone().requires_grad_(), None, group)


def step_counts(plan: TPPlan, autocast: bool) -> Counter:
    """The collectives of one step: forward, backward, sync_grads."""
    local = leaves_requiring_grad(shard_params(models.init_params(plan.spec.cfg, 0), plan))
    with count_collectives(by_dtype=True) as counts:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = parallel_loss(local, *batch(1, t=T), plan, chunk_tokens=16)
        loss.backward()
        sync_grads(local, plan)
    return counts


def check_counts(grid: RankGrid) -> None:
    """One step's collectives by kind and dtype (the README's table for gpt2-xl is this formula at 48 layers)."""
    # column/row pairs; loss chunks; steps per op
    layers, chunks, ring = 2 * model_spec(CFG).n_layer, 2 * T // 16, grid.tp - 1
    for sp, overlap in MODES:
        plan = plan_tp(CFG, grid, sequence_parallel=sp, overlap=overlap)
        got = step_counts(plan, autocast=True)
        if not sp:  # overlapped: the row-parallel all-reduce in CHUNKS blocks
            want = {("all_reduce", "bfloat16"): (CHUNKS + 1 if overlap else 2) * layers,
                    ("all_reduce", "float32"): 2 + 2 * chunks}
        elif not overlap:
            want = {("all_gather", "bfloat16"): 2 * layers, ("reduce_scatter", "bfloat16"): 2 * layers,
                    ("all_gather", "float32"): 2, ("reduce_scatter", "float32"): 2,
                    ("all_reduce", "float32"): 1 + 2 * chunks}
        else:
            want = {("ring_step", "bfloat16"): 4 * layers * ring, ("all_gather", "float32"): 2,
                    ("reduce_scatter", "float32"): 2, ("all_reduce", "float32"): 1 + 2 * chunks}
        assert got == Counter(want), f"sp={sp} overlap={overlap}: one bf16 step ran {dict(got)}, expected {want}"


def check_bf16(grid: RankGrid) -> None:
    """Under bf16 autocast (bf16 collectives) TP is as close to the fp32 truth as one process in bf16 is."""
    tokens, targets = batch(1, t=T)

    def reference(autocast: bool):
        full = leaves_requiring_grad(models.init_params(CFG, 0))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = models.loss(full, tokens, targets, CFG)
        loss.backward()
        return loss.detach(), tree_map(lambda t: t.grad, full)

    (loss32, grads32), (loss16, grads16) = reference(False), reference(True)
    # The loss is a mean over the tokens: one run's bf16 error can cancel to near zero (one process's measured
    # 2.6e-6 where a TP run's was 1.2e-5, AVX2 kernels), so its scale is also the per-token errors' RMS over
    # sqrt(tokens), the size of a mean's error; 4 of it (a normal tail of 6e-5), twice for TP's bf16 collectives.
    def token_losses(autocast: bool) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = models.logits(models.init_params(CFG, 0), tokens, CFG).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")

    noise = (token_losses(True) - token_losses(False))[targets.flatten() != -100]
    loss_scale = max(rel_err(loss16, loss32), (noise.pow(2).mean().sqrt() / noise.numel() ** 0.5 / loss32).item())
    for sp, overlap in MODES:
        plan = plan_tp(CFG, grid, sequence_parallel=sp, overlap=overlap)
        local = leaves_requiring_grad(shard_params(models.init_params(CFG, 0), plan))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = parallel_loss(local, tokens, targets, plan, chunk_tokens=16)
        loss.backward()
        sync_grads(local, plan)
        where = f"tp={grid.tp} sp={sp} overlap={overlap}"
        assert rel_err(loss, loss32) <= 8 * loss_scale + 1e-6, f"bf16 loss ({where}): scale {loss_scale:.1e}"
        truth, single = shard_params(grads32, plan), shard_params(grads16, plan)
        for (name, p), (_, e32), (_, e16) in zip(named_leaves(local), named_leaves(truth), named_leaves(single)):
            err, bound = rel_err(p.grad, e32), 2 * rel_err(e16, e32) + 1e-6
            assert err <= bound, f"bf16 grad of {name}: {err:.2e} from fp32, one process {bound / 2:.2e} ({where})"


def _world(rank: int, world: int) -> None:
    grid = build_grid(GridConfig(tp=world))
    check_overlapped_ops(grid.tp_group)
    dropout = preset("tiny", **{**CFG.__dict__, **DROPOUT})
    for sp, overlap in MODES:
        check_exact(plan_tp(CFG, grid, sequence_parallel=sp, overlap=overlap), seed=None, t=T)
        if overlap:
            check_exact(plan_tp(dropout, grid, sequence_parallel=sp, overlap=True), seed=5, t=T)
            check_training(plan_tp(CFG, grid, sequence_parallel=sp, overlap=True), steps=3, t=T)
    check_counts(grid)
    check_bf16(grid)


def test_uneven_heads_and_overlap_tp2():
    spawn(run_in_group, 2, ("gloo", _world), timeout_s=120, start_method="fork")


def test_uneven_heads_and_overlap_tp3():
    spawn(run_in_group, 3, ("gloo", _world), timeout_s=120, start_method="fork")


def fake_grid(tp: int, rank: int) -> RankGrid:
    """Coordinates only: sharding needs no process group."""
    return RankGrid(GridConfig(tp=tp), rank, 0, 0, None, None, None, tuple(range(tp)))


def test_uneven_shards_round_trip_exactly():
    """shard_params, shard_leaf (checkpoint save) and unshard_leaf (consolidate) agree, bit for bit."""
    params = models.init_params(CFG, 0)
    for tp in (2, 3):
        plans = [plan_tp(CFG, fake_grid(tp, r)) for r in range(tp)]
        assert [len(p.q_heads) for p in plans] == ([3, 2] if tp == 2 else [2, 2, 1])
        shards = [shard_params(params, p) for p in plans]
        for path, leaf in named_leaves(params):
            parts = [dict(named_leaves(s))[path] for s in shards]
            for plan, part in zip(plans, parts):
                assert torch.equal(shard_leaf(path, leaf, plan), part), f"shard_leaf({path}) tp={tp}"
            whole = unshard_leaf(path, parts, model_spec(CFG))
            assert torch.equal(whole, leaf), f"{path} does not round-trip at tp={tp}"
    xl = preset("gpt2-xl")
    plans = [plan_tp(xl, fake_grid(2, r)) for r in range(2)]
    assert [len(p.q_heads) for p in plans] == [13, 12] and [len(p.neurons) for p in plans] == [3200, 3200]
    qkv = next(leaf for leaf in plans[0].spec.leaves if leaf.placement.segments[:1] == ((Q_HEADS, 64),))
    rows = [shard_leaf(qkv.path, torch.empty(qkv.shape, device="meta"), p).shape[0] for p in plans]
    assert rows == [3 * 13 * 64, 3 * 12 * 64], f"{qkv.path} cut into {rows} rows"
