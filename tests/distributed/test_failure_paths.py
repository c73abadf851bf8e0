"""A rank killed (``kill -9``: no exception, no report) in the middle of a step stops every other rank,
each exiting by itself and naming the killed rank, in the engines whose collectives the tensor-parallel
kill test (``test_distributed``) does not reach:

- weight streaming under data parallelism (``stream/sharded.py``), 3 ranks: the last rank dies
  in the second step's backward, as it is about to reduce-scatter a block's gradient, while the others
  wait for it in that reduce-scatter; the run is guarded as ``tasks`` guard it (``DistContext.guard``);
- 3D parallelism (``compose``), tp 1 x pp 2 x dp 2 (4 ranks: the smallest world with both a pipeline
  and data parallelism): a rank of the last stage dies in the second step right after it has handed its
  stage's unit to the data-parallel engine (which starts its sum), which its replica partner then waits
  for; the step's own guard (``Parallel3DTrainer.step``) is the only one.

Each also with the rank stopped (SIGSTOP) instead: the others' gloo waits then raise nothing, as NCCL's
do not when a rank is killed, and only the failure watch's heartbeat stops them. Every rank's watch
sees the heartbeat stop within a poll or two of the others; the first must write it down for all
(``FailureWatch._run``), or rank 0, hosting the store, exits on its own finding and the ranks after it
blame rank 0 for the lost store. In a warm process (the whole suite forks from one) a step takes less
than a poll: a watch beats once as it starts, or a rank killed that early is said never to have started.
"""
from __future__ import annotations

import signal

import pytest
import torch
import torch.distributed as dist

from nanotrain.core import models as M
from nanotrain.core.models.gpt2 import GPT2Config
from nanotrain.data_parallel import DPConfig
from nanotrain.stream.zero_offload import zero_offload_trainer
from nanotrain.distributed import GridConfig, close_distributed, init_distributed
from nanotrain.distributed.failure import BEAT_KEY, FailureWatch
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.compose import Parallel3DTrainer, build_3d
from nanotrain.pipeline import build_schedule
from nanotrain.stream.trainer import StreamConfig
from tests.conftest import assert_killed_rank_named, kill_self
from tests.data_parallel.dp_cases import ADAM, CPU32

CFG = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_ctx=16)
SEQ, STEPS = 16, 1000  # many steps: a rank that is not stopped runs on until the spawner's timeout
DP_KILLED, P3D_KILLED = 2, 3  # not rank 0, which hosts the store (losing it is another failure)


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, CFG.vocab_size, (rows, SEQ), generator=torch.Generator().manual_seed(step))
    return x, x.roll(-1, dims=1)


def streamed_dp_killed(sig: int) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=3), "gloo", timeout_s=300, dead_after_s=5)
    scfg = StreamConfig(batch=6, micro_batch=1)
    with ctx.guard():
        trainer = zero_offload_trainer(CFG, M.init_params(CFG, seed=0), scfg, ADAM, CPU32, DPConfig(),
                                       dist.group.WORLD)
        reduce = trainer.opt.reduce

        def reduce_or_die(unit: str, grads: list[torch.Tensor]) -> torch.Tensor:
            if ctx.rank == DP_KILLED and trainer.step_count == 1 and unit.startswith("blocks."):
                kill_self(sig)
            return reduce(unit, grads)

        trainer.opt.reduce = reduce_or_die
        for step in range(STEPS):
            ctx.where = f"step {step}"
            trainer.step(*batch(step, scfg.batch))
    close_distributed(ctx)


def p3d_killed(sig: int) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(pp=2, dp=2), "gloo", timeout_s=300, dead_after_s=5)
    micro = 2
    p3d = build_3d(ctx, CFG, build_schedule("1f1b", 2, micro), SEQ, 1)
    trainer = Parallel3DTrainer(p3d, AdamConfig(lr=1e-3), OffloadConfig(device="cpu", dtype=torch.float32,
                                                                        offload=False))
    stage_done, step = trainer.stage_done, [0]

    def start_sum_then_die(stage: int) -> None:
        stage_done(stage)  # starts the stage's data-parallel sums
        if ctx.rank == P3D_KILLED and step[0] == 1:
            kill_self(sig)

    trainer.stage_done = start_sum_then_die
    for step[0] in range(STEPS):
        trainer.step(*batch(step[0], 2 * micro))
    close_distributed(ctx)


# How the rank dies: killed (gloo's waits in the others then fail at once, "connection reset by peer"), or
# stopped (they wait on: what NCCL's do when a rank is killed), which the spawner kills after grace_s.
HOW = {"killed": (signal.SIGKILL, None), "hung": (signal.SIGSTOP, 10)}


@pytest.mark.parametrize("how", HOW)
def test_a_killed_streamed_data_parallel_rank_stops_every_rank_naming_it(how):
    sig, grace_s = HOW[how]
    assert_killed_rank_named(streamed_dp_killed, 3, DP_KILLED, (sig,), grace_s=grace_s)


@pytest.mark.parametrize("how", HOW)
def test_a_killed_3d_rank_stops_every_rank_naming_it(how):
    sig, grace_s = HOW[how]
    assert_killed_rank_named(p3d_killed, 4, P3D_KILLED, (sig,), grace_s=grace_s)


def test_a_watch_beats_as_it_starts():
    store = dist.HashStore()
    watch = FailureWatch(store, rank=1, world_size=2, poll_s=60).start()
    assert store.check([BEAT_KEY.format(1)])  # before its first poll
    watch.stop()
