"""Packed rows under tensor parallelism with sequence parallelism (2 CPU ranks, GPT-2 and the Llama class): the
loss and every gradient (after ``sync_grads``) equal those of the batch's documents run one by one
(``tests.packed_cases``: bound and reference). Under SP each rank embeds its own tokens' positions (a slice of
the packed rows'), and its heads attend within each document of every row."""
from __future__ import annotations

from nanotrain.core.models import init_params, model_spec, preset, run
from nanotrain.data.batches import IGNORE_INDEX
from nanotrain.core.tree import named_leaves
from nanotrain.distributed import GridConfig, build_grid, run_in_group, spawn
from nanotrain.tensor_parallel import parallel_loss, plan_tp, shard_params, sync_grads
from tests.conftest import rel_err
from tests.packed_cases import one_by_one, packed_batch, packed_rtol
from tests.tensor_parallel.test_tp_gpt2 import leaves_requiring_grad

SPECS = [model_spec(preset("tiny", n_layer=2, n_embd=48, n_head=6, vocab_size=128)),
         model_spec(preset("tiny-llama", n_layer=2))]


def _check(rank: int, world: int) -> None:
    grid = build_grid(GridConfig(tp=2))
    for spec in SPECS:
        batch = packed_batch(spec.vocab_size)
        want_loss, want = one_by_one(spec, init_params(spec, seed=1), *batch)
        denom = int((batch[1] != IGNORE_INDEX).sum())
        loss_rtol, grad_rtol = packed_rtol(spec, batch[0], "loss"), packed_rtol(spec, batch[0])
        for sp in (False, True):
            plan = plan_tp(spec, grid, sequence_parallel=sp)
            local = leaves_requiring_grad(shard_params(init_params(spec, seed=1), plan))
            loss = parallel_loss(local, batch[0], batch[1], plan, denom=denom, chunk_tokens=8, positions=batch[2])
            loss.backward()
            sync_grads(local, plan)
            assert abs(float(loss) - want_loss) <= loss_rtol * want_loss, (spec.family, sp)
            expected = shard_params(run.tree_from(spec, want.items()), plan)
            for (path, p), (_, e) in zip(named_leaves(local), named_leaves(expected)):
                assert rel_err(p.grad, e) <= grad_rtol, (spec.family, sp, path)


def test_tensor_parallel_on_packed_rows():
    spawn(run_in_group, 2, ("gloo", _check), timeout_s=120, start_method="fork")
