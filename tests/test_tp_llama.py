"""The Llama-class family under tensor parallelism against one process (CPU, gloo, spawned ranks).

Grouped-query attention with each rank's query heads following their key/value head (6 query heads over 3
key/value heads: 4/2 query heads on two ranks, 2/2/2 on three; and over 2 on two ranks, 3/3), an MLP width of
100 (50/50, 34/33/33) on a fused gate|up matrix, rotary positions over the whole sequence, an untied head (Llama)
and a tied one with q/k/v biases (Qwen2), per-head q and k norms whose gradients each rank holds a part of
(Qwen3), seeded attention dropout, with and without sequence parallelism: the
loss, final hidden states, logits and every gradient within test_tp_gpt2's 1e-6, losses over AdamW steps within
its 1e-5. A tp above the key/value heads is refused, naming the fix.
"""
from __future__ import annotations

import pytest

from nanotrain.distributed import run_in_group, spawn
from nanotrain.distributed.grid import GridConfig, RankGrid
from nanotrain.models import preset
from nanotrain.tensor_parallel import build_grid, plan_tp
from tests.test_tp_gpt2 import check_exact, check_training

LLAMA = preset("tiny-llama", n_kv_head=3)
QWEN2 = preset("tiny-llama", n_kv_head=3, architecture="qwen2", tie_word_embeddings=True)
QWEN3 = preset("tiny-llama", n_kv_head=3, architecture="qwen3")  # q and k normalised per head, inside the region
T = 24  # a batch of 2 x 24 tokens splits over 2 and 3 ranks


def _world(rank: int, world: int) -> None:
    grid = build_grid(GridConfig(tp=world))
    for sp in (False, True):
        for cfg in (LLAMA, QWEN2, QWEN3, *((preset("tiny-llama"),) if world == 2 else ())):
            check_exact(plan_tp(cfg, grid, sequence_parallel=sp), seed=None, t=T)
        check_exact(plan_tp(preset("tiny-llama", n_kv_head=3, attention_dropout=0.1), grid, sequence_parallel=sp),
                    seed=5, t=T)
        check_training(plan_tp(QWEN2, grid, sequence_parallel=sp), steps=3, t=T)


def test_llama_tp2_exact_with_and_without_sequence_parallelism():
    spawn(run_in_group, 2, ("gloo", _world), timeout_s=120, start_method="fork")


def test_llama_tp3_exact_with_and_without_sequence_parallelism():
    spawn(run_in_group, 3, ("gloo", _world), timeout_s=120, start_method="fork")


def test_more_ranks_than_key_value_heads_is_refused_with_the_fix():
    grid = RankGrid(GridConfig(tp=4), 0, 0, 0, None, None, None, tuple(range(4)))
    with pytest.raises(ValueError, match=r"tp=4 is more than the model's 3 key/value heads .*use tp <= 3"):
        plan_tp(LLAMA, grid)
