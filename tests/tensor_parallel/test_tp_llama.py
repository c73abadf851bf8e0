"""The Llama-class family under tensor parallelism against one process (CPU, gloo, spawned ranks).

Grouped-query attention with each rank's query heads following their key/value head (6 query heads over 3
key/value heads: 4/2 query heads on two ranks, 2/2/2 on three; and over 2 on two ranks, 3/3), an MLP width of
100 (50/50, 34/33/33) on a fused gate|up matrix, rotary positions over the whole sequence, an untied head (Llama)
and a tied one with q/k/v biases (Qwen2), per-head q and k norms whose gradients each rank holds a part of
(Qwen3), seeded attention dropout, with and without sequence parallelism: the
loss, final hidden states, logits and every gradient within test_tp_gpt2's 1e-6, losses over AdamW steps within
its 1e-5.

More ranks than key/value heads (Megatron's replication): one key/value head on three ranks (2/2/2 query heads),
two on four ranks (each on two: 2/1 query heads), one on four (2/2/1/1): the same checks, and without the sum
over the ranks sharing a head its rows' gradients are off. The clipping norm counts every element once, each
shared head's rows included, within the same 1e-6: a norm of tensors each within 1e-6 of theirs is within 1e-6
(``|‖a‖ - ‖b‖| <= ‖a - b‖``); a head's rows counted twice is off by far more. Unsharding takes one copy of each
shared head. A tp that neither splits the key/value heads nor replicates each alike is refused, naming the fix.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nanotrain.core import models
from nanotrain.distributed import run_in_group, spawn
from nanotrain.distributed.grid import GridConfig, RankGrid
from nanotrain.core.models import model_spec, preset
from nanotrain.distributed import build_grid
from nanotrain.tensor_parallel import grad_norm, parallel_loss, plan_tp, shard_params, sync_grads
from nanotrain.tensor_parallel.shard import TPPlan, axis_ranges, unshard_leaf
from nanotrain.core.tree import get_path, named_leaves
from tests.conftest import chain_rtol, model_chain, rel_err
from tests.tensor_parallel.test_tp_gpt2 import batch, check_exact, check_training, leaves_requiring_grad

LLAMA = preset("tiny-llama", n_kv_head=3)
QWEN2 = preset("tiny-llama", n_kv_head=3, architecture="qwen2", tie_word_embeddings=True)
QWEN3 = preset("tiny-llama", n_kv_head=3, architecture="qwen3")  # q and k normalised per head, inside the region
ONE_KV = preset("tiny-llama", n_kv_head=1)
ONE_KV_QWEN2 = preset("tiny-llama", n_kv_head=1, architecture="qwen2", tie_word_embeddings=True)
TWO_KV_QWEN3 = preset("tiny-llama", architecture="qwen3")
T = 24  # a batch of 2 x 24 tokens splits over 2, 3 and 4 ranks
# per world size: the configs checked exactly, the one trained, the one with dropout
WORLDS = {2: ((LLAMA, QWEN2, QWEN3, preset("tiny-llama")), QWEN2, LLAMA),
          3: ((LLAMA, QWEN2, QWEN3, ONE_KV, ONE_KV_QWEN2), QWEN2, ONE_KV),
          4: ((preset("tiny-llama"), TWO_KV_QWEN3, ONE_KV_QWEN2), preset("tiny-llama"), preset("tiny-llama"))}


def check_norm(plan: TPPlan) -> None:
    """``grad_norm`` after ``sync_grads`` is the single process's gradient norm."""
    cfg, (tokens, targets) = plan.spec.cfg, batch(2, t=T)
    full = leaves_requiring_grad(models.init_params(cfg, 0))
    models.loss(full, tokens, targets, cfg).backward()
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.grad) for _, t in named_leaves(full)]))
    local = leaves_requiring_grad(shard_params(models.init_params(cfg, 0), plan))
    parallel_loss(local, tokens, targets, plan).backward()
    sync_grads(local, plan)
    got = grad_norm(local, plan)
    rtol = chain_rtol(model_chain(cfg, T, tokens.numel()))  # |‖a‖ - ‖b‖| <= ‖a - b‖: the gradients' bound
    assert rel_err(got, want) < rtol, f"norm {got.item()} != {want.item()} (tp={plan.grid.tp}, heads {plan.spec.heads})"


def _world(rank: int, world: int) -> None:
    grid = build_grid(GridConfig(tp=world))
    exact, trained, dropout = WORLDS[world]
    for sp in (False, True):
        for cfg in exact:
            plan = plan_tp(cfg, grid, sequence_parallel=sp)
            check_exact(plan, seed=None, t=T)
            check_norm(plan)
            if plan.kv_group is not None:  # a shared head's rows: each rank's gradient is its query heads' part
                with pytest.raises(AssertionError, match=r"grad of blocks\.0\.qkv_w"):
                    check_exact(replace(plan, kv_group=None), seed=None, t=T)
        check_exact(plan_tp(replace(dropout, attention_dropout=0.1), grid, sequence_parallel=sp), seed=5, t=T)
        check_training(plan_tp(trained, grid, sequence_parallel=sp), steps=3, t=T)


def test_llama_tp2_exact_with_and_without_sequence_parallelism():
    spawn(run_in_group, 2, ("gloo", _world), timeout_s=120, start_method="fork")


def test_llama_tp3_exact_with_and_without_sequence_parallelism_one_key_value_head_replicated():
    spawn(run_in_group, 3, ("gloo", _world), timeout_s=120, start_method="fork")


def test_llama_tp4_key_value_heads_replicated_exact_with_and_without_sequence_parallelism():
    spawn(run_in_group, 4, ("gloo", _world), timeout_s=120, start_method="fork")


@pytest.mark.parametrize("cfg,tp,heads", [(ONE_KV, 3, [(0, 2), (2, 4), (4, 6)]),
                                          (preset("tiny-llama"), 4, [(0, 2), (2, 3), (3, 5), (5, 6)]),
                                          (ONE_KV_QWEN2, 4, [(0, 2), (2, 4), (4, 5), (5, 6)])])
def test_replicated_key_value_heads_shard_and_unshard_to_one_copy(cfg, tp, heads):
    spec, params = model_spec(cfg), models.init_params(cfg, seed=3)
    plans = [TPPlan(spec, None, False, *axis_ranges(spec, tp, r)) for r in range(tp)]
    assert [(p.q_heads.start, p.q_heads.stop) for p in plans] == heads
    assert [p.kv_heads.start for p in plans] == [r * spec.heads[1] // tp for r in range(tp)]
    shards = [shard_params(params, p) for p in plans]
    for leaf in spec.leaves:
        whole = unshard_leaf(leaf.path, [get_path(s, leaf.path) for s in shards], spec)
        assert torch.equal(whole, get_path(params, leaf.path)), leaf.path


@pytest.mark.parametrize("cfg,tp,fix", [(preset("tiny-llama"), 5, "1, 2, 4, 6"), (LLAMA, 4, "1, 2, 3, 6"),
                                        (ONE_KV, 7, "1, 2, 3, 4, 5, 6")])
def test_a_tp_that_neither_splits_nor_replicates_the_key_value_heads_is_refused_with_the_fix(cfg, tp, fix):
    grid = RankGrid(GridConfig(tp=tp), 0, 0, 0, None, None, None, tuple(range(tp)))
    kv = cfg.n_kv_head
    with pytest.raises(ValueError, match=rf"tp={tp} neither splits the model's {kv} key/value heads .*; use tp in "
                                         rf"{fix}$"):
        plan_tp(cfg, grid)
