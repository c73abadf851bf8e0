"""The rank grid, the pipeline on a subgroup of a larger world, and the failure watch of every engine.

Grids are checked twice: on paper (``GridConfig.members``, no process group) for several shapes
and orders, and in a 4-process gloo world, where each group's ranks must be what the paper says.
The same world runs two pipelines of two stages side by side (a pp x dp grid), each replica on its
own data, and each must equal one process on that data: peers, the loss broadcast and the tied
embedding's group all live in the replica's pp group, not in the world.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nanotrain.core.models import preset
from nanotrain.distributed import GridConfig, build_grid, close_distributed, init_distributed, spawn
from nanotrain.core.models import init_params, loss as gpt2_loss
from nanotrain.pipeline import LayeredModel, build_pipeline, build_schedule, train_step
from nanotrain.tensor_parallel import parallel_loss, plan_tp, shard_params, sync_grads
from nanotrain.core.tree import named_leaves, tree_map
from nanotrain.core.optim import AdamConfig
from tests.conftest import adam_bounds, assert_killed_rank_named, chain_rtol, kill_self, model_chain

CFG = preset("tiny", n_layer=4, n_embd=32, n_head=4, n_ctx=16, vocab_size=256)
MICRO, MB_SIZE, SEQ, STEPS, LR = 4, 2, 16, 3, 1e-2
ADAM = AdamConfig(lr=LR, weight_decay=0.01)  # torch.optim.AdamW's, as both sides run it


@pytest.mark.parametrize("config, expected", [
    (GridConfig(tp=2, dp=2, pp=2),  # default order tp-dp-pp: tp innermost, pp outermost
     {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
      "pp": [[0, 4], [1, 5], [2, 6], [3, 7]]}),
    (GridConfig(tp=2, dp=2, pp=2, order=("tp", "pp", "dp")),
     {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
      "pp": [[0, 2], [1, 3], [4, 6], [5, 7]]}),
    (GridConfig(tp=1, dp=4, pp=2), {"tp": [[i] for i in range(8)], "dp": [[0, 1, 2, 3], [4, 5, 6, 7]],
                                    "pp": [[0, 4], [1, 5], [2, 6], [3, 7]]}),
    (GridConfig(tp=3, dp=1, pp=2, order=("pp", "tp", "dp")),
     {"tp": [[0, 2, 4], [1, 3, 5]], "dp": [[i] for i in range(6)], "pp": [[0, 1], [2, 3], [4, 5]]}),
])
def test_grid_groups_on_paper(config, expected):
    for axis, groups in expected.items():
        assert sorted(config.members(axis)) == groups, axis
    for index in range(config.size):  # coordinates and indices are inverse maps
        assert config.index(config.coords(index)) == index
    every = sorted(r for g in config.members("tp") for r in g)
    assert every == list(range(config.size))


def test_grid_refuses_bad_sizes_and_orders():
    with pytest.raises(ValueError, match="GridConfig.pp=0 must be at least 1"):
        GridConfig(pp=0)
    with pytest.raises(ValueError, match="must name each of tp, pp, dp once"):
        GridConfig(order=("tp", "tp", "dp"))


def replica_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (STEPS, MICRO, MB_SIZE, SEQ), generator=gen)
    targets = torch.randint(0, CFG.vocab_size, (STEPS, MICRO, MB_SIZE, SEQ), generator=gen)
    targets[..., :2] = -100
    return tokens, targets


def one_process(seed: int) -> tuple[list[float], list[dict]]:
    """Each step's loss and gradients on replica ``seed``'s data."""
    params = tree_map(lambda t: t.requires_grad_(), init_params(CFG, seed=0))
    opt = torch.optim.AdamW([t for _, t in named_leaves(params)], lr=LR)
    tokens, targets = replica_data(seed)
    losses, grads = [], []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = gpt2_loss(params, tokens[s].flatten(0, 1), targets[s].flatten(0, 1), CFG)
        loss.backward()
        grads.append({path: t.grad.clone() for path, t in named_leaves(params)})
        opt.step()
        losses.append(loss.item())
    return losses, grads


def grid_world() -> dict:
    """4 ranks: each grid's groups as built, then two 2-stage pipelines under two grid orders."""
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(pp=2, dp=2), "gloo", timeout_s=60)
    out = {"groups": {}, "pipelines": {}}
    with ctx.guard():
        for config in (GridConfig(tp=2, dp=2), GridConfig(tp=2, pp=2, order=("pp", "tp", "dp")), GridConfig(dp=4)):
            grid = build_grid(config, timeout=ctx.grid.timeout)
            out["groups"][config] = {axis: dist.get_process_group_ranks(getattr(grid, f"{axis}_group"))
                                     for axis in ("tp", "dp", "pp")}
        for order in (("tp", "dp", "pp"), ("pp", "tp", "dp")):  # pp ranks apart, then adjacent
            ctx.grid = build_grid(GridConfig(pp=2, dp=2, order=order), timeout=ctx.grid.timeout)
            for name, virtual in (("1f1b", 1), ("interleaved-1f1b", 2)):
                tokens, targets = replica_data(seed=ctx.grid.dp_rank)
                pipe = build_pipeline(ctx, LayeredModel.from_spec(CFG, SEQ), build_schedule(name, 2, MICRO, virtual),
                                      tokens[0, 0], seed=0)
                opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
                start, losses, grads = {path: t.detach().clone() for path, t in pipe.named_parameters()}, [], []
                for s in range(STEPS):  # each step's loss and the gradients AdamW applied
                    losses.append(float(train_step(pipe, opt, tokens[s], targets[s])))
                    grads.append({path: t.grad.clone() for path, t in pipe.named_parameters()})
                out["pipelines"][order, name] = (ctx.grid.dp_rank, losses, grads, start)
    close_distributed(ctx)
    return out


def test_grids_and_two_pipelines_in_one_world():
    per_rank = spawn(grid_world, 4, timeout_s=120, start_method="fork")
    for config in per_rank[0]["groups"]:
        for rank, result in enumerate(per_rank):
            for axis, ranks in result["groups"][config].items():
                mine = [g for g in config.members(axis) if rank in g]
                assert ranks == mine[0], f"{config}: rank {rank}'s {axis} group {ranks}, expected {mine[0]}"
    reference = {d: one_process(seed=d) for d in (0, 1)}
    loss_rtol = chain_rtol(model_chain(CFG, SEQ, MICRO * MB_SIZE * SEQ, "loss"))
    for key in per_rank[0]["pipelines"]:
        moved = {0: [0.0] * STEPS, 1: [0.0] * STEPS}  # per replica: its stages' moves of each loss, summed
        for replica, _, grads, start in (r["pipelines"][key] for r in per_rank):
            ref_grads = [{p: g[p] for p in start} for g in reference[replica][1]]
            moved[replica] = [a + b for a, b in zip(moved[replica], adam_bounds(start, grads, ref_grads, ADAM)[1])]
        for replica, losses, _, _ in (r["pipelines"][key] for r in per_rank):
            # the first loss within the chain's bound, the later ones plus what the updates move them
            ref = reference[replica][0]
            bounds = [loss_rtol * abs(b) + m for b, m in zip(ref, moved[replica], strict=True)]
            assert all(abs(a - b) <= c for a, b, c in zip(losses, ref, bounds, strict=True)), (key, losses, ref)
    assert reference[0][0] != reference[1][0]  # the replicas really saw different data


def tp_worker_killed() -> None:
    """3 tensor-parallel ranks train; rank 2 is killed (no exception, no report) at the second step."""
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(tp=3), "gloo", timeout_s=300, dead_after_s=5)
    plan = plan_tp(CFG, ctx.grid)
    params = tree_map(lambda t: t.requires_grad_(), shard_params(init_params(CFG, seed=0), plan))
    tokens = torch.randint(0, CFG.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with ctx.guard():
        for step in range(1000):
            ctx.where = f"step {step}"
            if step == 2 and ctx.rank == 2:
                kill_self()
            parallel_loss(params, tokens, tokens, plan).backward()
            sync_grads(params, plan)
    close_distributed(ctx)


def test_a_killed_tensor_parallel_rank_stops_every_rank_naming_it():
    assert_killed_rank_named(tp_worker_killed, 3, killed=2)
