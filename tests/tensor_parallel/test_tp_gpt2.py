"""Tensor-parallel GPT-2 against the single-process model: outputs, loss, every gradient, training.

Runs on CPU with gloo in spawned ranks. The tiny model has 6 heads (uneven over 4 ranks) and a
vocabulary of 251 (padded), and the loss is chunked, so each special case is on the path.

Tolerance: 1e-6 relative (norm of the difference over the norm of the reference, per tensor).
That is the fp32 noise floor here, not slack: the single-process fp32 LayerNorm gradients are
themselves ~7e-7 from an fp64 run, because they are sums with heavy cancellation.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from nanotrain.core import models
from nanotrain.core.models import preset, run
from nanotrain.core.optim import AdamConfig
from nanotrain.distributed import GridConfig, build_grid
from nanotrain.tensor_parallel import (TPOps, parallel_hidden_states, parallel_logits, parallel_loss, plan_tp,
                                       shard_params, sync_grads)
from nanotrain.tensor_parallel.comms import all_gather_split
from nanotrain.distributed import average_grads, run_in_group, spawn
from nanotrain.tensor_parallel.shard import TPPlan, replicated_leaves
from nanotrain.core.tree import Tree, named_leaves, tree_map
from tests.conftest import adam_bounds, chain_rtol, model_chain, rel_err

ADAM = AdamConfig(lr=1e-2, weight_decay=0.1)  # train_losses' torch.optim.AdamW
CFG = preset("tiny", n_layer=2, n_embd=48, n_head=6, vocab_size=251, n_ctx=32)
DROPOUT = dict(embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1)
CFG_DROPOUT = preset("tiny", **{**CFG.__dict__, **DROPOUT})  # dropout on where a seed is given


def batch(seed: int, b: int = 2, t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (b, t), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (b, t), generator=g)
    targets[0, :3] = -100
    return tokens, targets


def leaves_requiring_grad(tree: Tree) -> Tree:
    return tree_map(lambda t: t.detach().clone().requires_grad_(), tree)


def gather_tokens(x: torch.Tensor, plan: TPPlan) -> torch.Tensor:
    return all_gather_split(x, plan.grid.tp_group, dim=0) if plan.sequence_parallel else x


@contextmanager
def count_collectives(by_dtype: bool = False) -> Iterator[Counter]:
    """Count the collectives torch.distributed is asked for while the block runs: by kind, or by (kind,
    dtype) with ``by_dtype``; a ring step of the overlapped layers is one ``batch_isend_irecv``."""
    counts: Counter = Counter()
    kinds = {"all_reduce": "all_reduce", "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
             "batch_isend_irecv": "ring_step"}
    originals = {name: getattr(dist, name) for name in kinds if hasattr(dist, name)}

    def counting(name):
        def call(*args, **kwargs):
            if by_dtype:
                first = args[0][0].tensor if name == "batch_isend_irecv" else args[-1] if "gather" in name else args[0]
                counts[kinds[name], str(first.dtype).removeprefix("torch.")] += 1
            else:
                counts[kinds[name]] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def check_exact(plan: TPPlan, seed: int | None, t: int = 16) -> None:
    """Loss, final hidden states, logits and every gradient (after sync_grads) match the model."""
    cfg, tokens, targets = plan.spec.cfg, *batch(1, t=t)
    full = leaves_requiring_grad(models.init_params(cfg, 0))
    ref_loss = models.loss(full, tokens, targets, cfg, seed=seed)
    ref_loss.backward()
    local = leaves_requiring_grad(shard_params(models.init_params(cfg, 0), plan))
    loss = parallel_loss(local, tokens, targets, plan, seed=seed, chunk_tokens=8)
    loss.backward()
    if plan.sequence_parallel and plan.grid.tp > 1:
        # Before the reduction a replicated parameter's gradient (the first norm's) covers this rank's tokens only.
        norm = next(k for k in plan.spec.block_keys if plan.spec.leaf(f"blocks.0.{k}").placement.replicated)
        ln_grad, ln_ref = local["blocks"][0][norm].grad, full["blocks"][0][norm].grad
        assert rel_err(ln_grad, ln_ref) > 1e-2, "sequence-parallel norm gradient should be partial before sync"
    sync_grads(local, plan)
    where = (f"tp={plan.grid.tp} sp={plan.sequence_parallel} overlap={plan.overlap} seed={seed} "
             f"heads={plan.spec.heads[0]}")
    rtol = {what: chain_rtol(model_chain(cfg, t, tokens.numel(), what)) for what in ("logits", "loss", "grads")}
    assert rel_err(loss, ref_loss) < rtol["loss"], f"loss {loss.item()} != {ref_loss.item()} ({where})"
    expected = shard_params(tree_map(lambda t: t.grad, full), plan)
    for (name, p), (_, e) in zip(named_leaves(local), named_leaves(expected)):
        err = rel_err(p.grad, e)
        assert err < rtol["grads"], f"grad of {name}: relative error {err:.2e} ({where})"
    with torch.no_grad():  # the hidden states: the logits' chain but the head's matmul, so within its bound
        params = models.init_params(cfg, 0)
        h = gather_tokens(parallel_hidden_states(shard_params(params, plan), tokens, plan, seed), plan)
        want = models.hidden_states(params, tokens, cfg, seed).reshape(h.shape)
        assert rel_err(h, want) < rtol["logits"], f"hidden ({where})"
        logits = parallel_logits(shard_params(params, plan), tokens, plan)
        assert rel_err(logits, models.logits(params, tokens, cfg)) < rtol["logits"], f"logits ({where})"


def train_losses(step_fn, params: Tree, steps: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Each step's loss and the gradients AdamW (``ADAM``) applied, by path."""
    leaves = [p for _, p in named_leaves(params)]
    opt = torch.optim.AdamW(leaves, lr=ADAM.lr, weight_decay=ADAM.weight_decay)
    losses, grads = [], []
    for i in range(steps):
        opt.zero_grad()
        losses.append(step_fn(params, i))
        grads.append({path: p.grad.clone() for path, p in named_leaves(params)})
        opt.step()
    return losses, grads


def check_training(plan: TPPlan, steps: int = 4, t: int = 16) -> None:
    """Several AdamW steps give the single-process losses (the padding rows stay zero): each within the chain's
    bound plus what the earlier steps' updates, AdamW of the gradients each side applied, move it
    (``conftest.adam_bounds`` of this rank's shards, summed over the ranks: replicated leaves counted again, an
    upper bound)."""
    cfg = plan.spec.cfg

    def ref_step(params, i):
        loss = models.loss(params, *batch(10 + i, t=t), cfg)
        loss.backward()
        return loss.item()

    def tp_step(local, i):
        loss = parallel_loss(local, *batch(10 + i, t=t), plan, chunk_tokens=8)
        loss.backward()
        sync_grads(local, plan)
        return loss.item()

    ref, ref_grads = train_losses(ref_step, leaves_requiring_grad(models.init_params(cfg, 0)), steps)
    local = leaves_requiring_grad(shard_params(models.init_params(cfg, 0), plan))
    start = {path: p.detach().clone() for path, p in named_leaves(local)}
    got, grads = train_losses(tp_step, local, steps)
    mine = [dict(named_leaves(shard_params(run.tree_from(plan.spec, g.items()), plan))) for g in ref_grads]
    moved = torch.tensor(adam_bounds(start, grads, mine, ADAM)[1], dtype=torch.float64)
    dist.all_reduce(moved, group=plan.grid.tp_group)
    tokens = batch(0, t=t)[0].numel()
    loss_rtol = chain_rtol(model_chain(cfg, t, tokens, "loss"))
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        where = f"tp={plan.grid.tp} sp={plan.sequence_parallel} overlap={plan.overlap} heads={plan.spec.heads[0]}"
        assert abs(a - b) <= loss_rtol * abs(b) + moved[i], f"step {i}: loss {a} != {b} ({where})"
    real_rows = max(min(plan.spec.vocab_size - plan.vocab.start, len(plan.vocab)), 0)
    assert local["wte"][real_rows:].abs().sum().item() == 0, "the padding rows of wte moved in training"


def check_collective_counts(grid) -> None:
    """One all-reduce per MLP forward and one in its backward; sequence parallel: none, a gather and a scatter."""
    x = torch.randn(32, CFG.n_embd, requires_grad=True)
    for sp in (False, True):
        plan = plan_tp(CFG, grid, sequence_parallel=sp)
        block = shard_params(models.init_params(CFG, 0), plan)["blocks"][0]
        xs = x.detach()[: 32 // grid.tp].clone().requires_grad_() if sp else x
        with count_collectives() as fwd:
            y = run.mlp(plan.spec, block, xs, TPOps(plan, (2, 16)))
        with count_collectives() as bwd:
            y.sum().backward()
        if sp:
            assert fwd == Counter(all_gather=1, reduce_scatter=1), f"sequence-parallel MLP forward ran {dict(fwd)}"
            assert bwd == Counter(all_gather=1, reduce_scatter=1), f"sequence-parallel MLP backward ran {dict(bwd)}"
        else:
            assert fwd == Counter(all_reduce=1), f"MLP forward ran {dict(fwd)}, expected one all-reduce"
            assert bwd == Counter(all_reduce=1), f"MLP backward ran {dict(bwd)}, expected one all-reduce"
    # Whole model, no SP: one per attention and per MLP, one for the embedding, two per loss chunk.
    plan = plan_tp(CFG, grid)
    local = shard_params(models.init_params(CFG, 0), plan)
    with torch.no_grad(), count_collectives() as fwd:
        parallel_loss(local, *batch(1), plan, chunk_tokens=8)
    assert fwd == Counter(all_reduce=2 * CFG.n_layer + 1 + 2 * 4), f"model forward ran {dict(fwd)}"


def _tp2(rank: int, world: int) -> None:
    grid = build_grid(GridConfig(tp=2))
    check_collective_counts(grid)
    for sp in (False, True):
        check_exact(plan_tp(CFG, grid, sequence_parallel=sp), seed=None)
        check_exact(plan_tp(CFG_DROPOUT, grid, sequence_parallel=sp), seed=5)
        check_training(plan_tp(CFG, grid, sequence_parallel=sp))


def _tp4_and_dp(rank: int, world: int) -> None:
    grid = build_grid(GridConfig(tp=4))
    for sp in (False, True):
        check_exact(plan_tp(CFG, grid, sequence_parallel=sp), seed=None)
        check_training(plan_tp(CFG, grid, sequence_parallel=sp), steps=3)
    check_exact(plan_tp(CFG_DROPOUT, grid, sequence_parallel=True), seed=5)
    check_data_parallel(build_grid(GridConfig(tp=2, dp=2)))


def check_data_parallel(grid) -> None:
    """tp=2 x dp=2: each replica takes half the batch; averaged gradients equal the full batch's."""
    plan = plan_tp(CFG, grid, sequence_parallel=True)
    assert (grid.tp_rank, grid.dp_rank) == (dist.get_rank() % 2, dist.get_rank() // 2)
    tokens, targets = batch(3, b=4)
    targets[0, :3] = 5  # every replica must average over equally many tokens for the mean to be exact
    full = leaves_requiring_grad(models.init_params(CFG, 0))
    ref = models.loss(full, tokens, targets, CFG)
    ref.backward()
    mine = slice(2 * grid.dp_rank, 2 * grid.dp_rank + 2)
    local = leaves_requiring_grad(shard_params(models.init_params(CFG, 0), plan))
    loss = parallel_loss(local, tokens[mine], targets[mine], plan)
    loss.backward()
    sync_grads(local, plan)
    average_grads([p for _, p in named_leaves(local)], grid.dp_group)
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=grid.dp_group)
    loss_rtol, grad_rtol = (chain_rtol(model_chain(CFG, tokens.shape[1], tokens.numel(), w)) for w in ("loss", "grads"))
    assert rel_err(mean / grid.dp, ref) < loss_rtol, f"data-parallel loss {mean.item() / grid.dp} != {ref.item()}"
    expected = shard_params(tree_map(lambda t: t.grad, full), plan)
    for (name, p), (_, e) in zip(named_leaves(local), named_leaves(expected)):
        assert rel_err(p.grad, e) < grad_rtol, f"tp x dp grad of {name}: relative error {rel_err(p.grad, e):.2e}"
    assert len(replicated_leaves(local, plan.spec)) == 3 + 6 * CFG.n_layer


def test_gpt2_tp2_exact_with_and_without_sequence_parallel():
    spawn(run_in_group, 2, ("gloo", _tp2), timeout_s=120, start_method="fork")


def test_gpt2_tp4_exact_and_composes_with_data_parallel():
    spawn(run_in_group, 4, ("gloo", _tp4_and_dp), timeout_s=120, start_method="fork")
