"""ZeRO-3 skips a step on every rank when one rank's gradient holds a single inf in one element that another rank's
shard holds: before the reduction each rank spreads its own non-finite sum to one parameter element of every rank's
shard (``buckets.spread_nonfinite``), so no rank updates a unit another skips (3 gloo ranks, fp32; exact
skips, as the unit is not the first of the backward)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanotrain.core.models import init_params, preset
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.resident import TrainConfig
from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, spawn

CFG = preset("tiny-llama", n_layer=2)
WORLD, BAD = 3, 2


def worker() -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=WORLD), "gloo", timeout_s=60)
    with ctx.guard():
        ocfg = OffloadConfig(device="cpu", dtype=torch.float32, offload=False, exact_skip=True)  # a later unit
        trainer = data_parallel_trainer(CFG, init_params(CFG, seed=1), TrainConfig(6, 1, "none"), AdamConfig(lr=1e-3),
                                        ocfg, DPConfig(zero=3), dist.group.WORLD)
        engine = trainer.inner.weights
        tokens = torch.randint(0, CFG.vocab_size, (3, 6, 17), generator=torch.Generator().manual_seed(0))
        trainer.step(tokens[0, :, :-1], tokens[0, :, 1:])
        b = engine.bucket["blocks.1"]
        path = b.paths[0]  # its element 0 is in the first rank's shard, not the bad rank's
        assert b.offsets[0] < b.shard
        add = engine.add_grads

        def poisoned(k: int, grads: dict) -> None:
            if ctx.rank == BAD and path in grads:
                grads[path].view(-1)[0] = float("inf")
            add(k, grads)
        engine.add_grads = poisoned
        state = engine.opt.inner.state_dict
        before = {k: v.clone() for k, v in state().items() if "." in k}  # masters and moments, not the counts
        trainer.step(tokens[1, :, :-1], tokens[1, :, 1:])
        counts = (trainer.opt.steps, trainer.opt.skipped_steps)
        unchanged = all(torch.equal(before[k], state()[k]) for k in before)
        engine.add_grads = add
        trainer.step(tokens[2, :, :-1], tokens[2, :, 1:])
        out = {"counts": counts, "unchanged": unchanged, "resumed": (trainer.opt.steps, trainer.opt.skipped_steps)}
        trainer.close()
    close_distributed(ctx)
    return out


def test_one_ranks_single_inf_skips_the_step_on_every_rank():
    for rank, r in enumerate(spawn(worker, WORLD, (), start_method="fork", timeout_s=60)):
        assert r == {"counts": (1, 1), "unchanged": True, "resumed": (2, 1)}, (rank, r)
