"""Every process group a run makes waits no longer than the run's timeout (``init_distributed``'s ``timeout_s``),
not torch's default for a new group (30 minutes on gloo, 10 on NCCL).

Two 3-rank gloo worlds. In the first, each group the library makes (the grid's tp, dp and pp groups, a pipeline's
tied-leaf group, a tensor-parallel key/value head's group) is read back for its timeout. In the second, with a 3 s
timeout, two ranks all-reduce in their dp group while the third, alive and beating, never joins (a mismatched
collective, as when ranks take different branches): the two must give up at the world's 3 s, naming the timeout.
Nothing else stops them there, because the failure watch reacts only to a rank that fails or stops beating.
"""
from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from nanotrain.core.models import preset
from nanotrain.distributed import GridConfig, SpawnError, build_grid, close_distributed, init_distributed, spawn
from nanotrain.pipeline import LayeredModel, build_pipeline, build_schedule
from nanotrain.tensor_parallel import plan_tp

WORLD = 3
GPT2 = preset("tiny", n_layer=3, n_embd=32, n_head=4, n_ctx=16, vocab_size=256)  # tied wte: first and last stage
LLAMA = preset("tiny-llama", n_kv_head=1)  # one key/value head over tp=3: its group holds every tp rank
RUN_S, SHORT_S = 45, 3  # neither torch's default (1800 s) nor init_distributed's (120 s)


def timeout_of(group: dist.ProcessGroup) -> timedelta:
    """The timeout a gloo group was made with (torch has no public getter; its backend's options hold it)."""
    return group._get_backend(torch.device("cpu")).options._timeout


def every_group() -> dict[str, timedelta]:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(pp=WORLD), "gloo", timeout_s=RUN_S)
    with ctx.guard():
        out = {f"grid {axis}": timeout_of(getattr(ctx.grid, f"{axis}_group")) for axis in ("tp", "dp", "pp")}
        # the key/value group first: torch names a group made by its members alone from how many groups each
        # holds, and after the tied groups the middle stage holds one fewer than the others (in a run, the ranks
        # sharing a key/value head are one stage's and hold alike)
        plan = plan_tp(LLAMA, build_grid(GridConfig(tp=WORLD), timeout=ctx.grid.timeout))
        out["key/value head"] = timeout_of(plan.kv_group)
        tokens = torch.zeros(2, 16, dtype=torch.long)
        pipe = build_pipeline(ctx, LayeredModel.from_spec(GPT2, 16), build_schedule("1f1b", WORLD, 2), tokens)
        out.update({f"tied {path}": timeout_of(group) for path, group in pipe.tied})
    close_distributed(ctx)
    return out


def test_every_group_of_a_run_has_the_worlds_timeout():
    per_rank = spawn(every_group, WORLD, timeout_s=120, start_method="fork")
    for rank, groups in enumerate(per_rank):
        tied = [name for name in groups if name.startswith("tied")]
        assert len(tied) == (0 if rank == 1 else 1), groups  # the middle stage holds no copy of wte
        assert len(groups) == 3 + len(tied) + 1, groups
        assert groups == {name: timedelta(seconds=RUN_S) for name in groups}, f"rank {rank}: {groups}"


def one_rank_skips_a_dp_all_reduce() -> None:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=WORLD), "gloo", timeout_s=SHORT_S)
    with ctx.guard():
        ctx.where = "the dp all-reduce"
        if ctx.rank == WORLD - 1:
            time.sleep(60)  # alive, beating, in no collective: only the others' own timeout can end their wait
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=ctx.grid.dp_group)
        except RuntimeError as e:
            raise RuntimeError(f"dp all-reduce gave up after {time.monotonic() - start:.2f} s: {e}") from e
    close_distributed(ctx)


def test_a_grid_group_times_out_at_the_worlds_timeout():
    start = time.monotonic()
    with pytest.raises(SpawnError) as info:  # torch's default would leave the spawner's 30 s to end it
        spawn(one_rank_skips_a_dp_all_reduce, WORLD, timeout_s=30, start_method="fork", grace_s=10)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "timed out after 30 s" not in message, message
    waits = [float(s) for s in re.findall(r"dp all-reduce gave up after ([0-9.]+) s", message)]
    assert waits, message
    # gloo's wait ends at its deadline, give or take a scheduler tick; 4 s of slack for a loaded 2-core machine
    assert all(SHORT_S - 0.1 <= w < SHORT_S + 4 for w in waits), waits
    assert f"Timed out waiting {SHORT_S * 1000}ms" in message, message  # gloo's own words name the world's timeout
    assert elapsed < 20, f"took {elapsed:.1f} s"
