"""LoRA under DDP and ZeRO-1/2 on 2 and 3 CPU processes reproduces one process on the same global batch (fp32):
every step's loss and, after 3 AdamW steps, the pairs' masters and both moments, with ``test_data_parallel``'s
bounds (``assert_steps_match``): the first loss and gradients within the micro-batches' sum (the same kernels on
every side, the sums over ranks instead of micro-batches), each master and moment within what AdamW makes of the
gradients each side applied, each later loss within the first's bound plus what that distance moves it. The frozen
base is every rank's own copy, outside the optimizer: only the pairs' gradients are reduced (and their state
sharded). One forked world per size runs every configuration."""
from __future__ import annotations

import pytest
import torch

from nanotrain.core.models import model_spec, preset, run
from nanotrain.core.models.lora import LoraConfig, with_lora
from nanotrain.core.optim import OffloadConfig
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from tests.conftest import chain_rtol, rel_err
from tests.data_parallel.dp_cases import ADAM, BATCH, MICRO, assert_steps_match, buckets, reduced_grads, spied

SPEC = with_lora(model_spec(preset("tiny-llama")), LoraConfig(4, 8.0, ("q", "v", "down"), dropout=0.1))
CPU32 = OffloadConfig(device="cpu", dtype=torch.float32)
TCFG = TrainConfig(batch=BATCH, micro_batch=MICRO, recompute="every")  # assert_steps_match's AdamW and batch
RUNS = {"ddp": DPConfig(zero=0, bucket_mb=0.01), "zero1": DPConfig(zero=1), "zero2": DPConfig(zero=2, bucket_mb=0)}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(3):
        x = torch.randint(0, SPEC.vocab_size, (BATCH, 16), generator=g)
        y = x.roll(-1, dims=1)
        y[:, -3:] = -100
        out.append((x, y))
    return out


def one_process() -> dict:
    """The reference: each step's loss and gradients, as its AdamW applied them; the final state."""
    trainer = ResidentTrainer(SPEC, run.init_params(SPEC, seed=1), TCFG, ADAM, CPU32)
    losses, grads = [], []
    for x, y in batches():
        losses.append(trainer.step(x, y).loss)
        grads.append({p: t.clone() for p, t in trainer.weights.accum.items()})
    state = {k: v.clone() for k, v in trainer.state_dict().items()}
    trainer.close()
    return {"losses": losses, "grads": grads, "state": state}


def steps(trainer) -> dict:
    """The losses, each step's reduced gradients as the inner AdamW received them (``spied``), the final state."""
    grads = []
    spied(trainer, grads)
    losses = [(grads.append([]), trainer.step(x, y).loss)[1] for x, y in batches()]
    state = {k: v.clone() for k, v in trainer.state_dict().items()}
    trainer.close()
    return {"losses": losses, "grads": grads, "state": state, "buckets": buckets(trainer)}


def worker() -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "gloo", timeout_s=60)
    with ctx.guard():  # a failing rank stops every rank, named
        out = {name: steps(data_parallel_trainer(SPEC, run.init_params(SPEC, seed=1), TCFG, ADAM, CPU32, dcfg,
                                                 ctx.grid.dp_group)) for name, dcfg in RUNS.items()}
    close_distributed(ctx)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_lora_data_parallel_equals_one_process(world):
    torch.set_num_threads(1)
    ref = one_process()
    per_rank = spawn(worker, world, (), start_method="fork", timeout_s=120)
    for name, dcfg in RUNS.items():
        runs = [r[name] for r in per_rank]
        grads = [reduced_grads(runs, dcfg.zero, s) for s in range(len(ref["losses"]))]
        assert set(grads[0]) == set(ref["grads"][0]), name  # the pairs' alone
        for path, g in grads[0].items():  # each micro-batch's the same kernels': only the sum of the 6 reorders
            assert rel_err(g, ref["grads"][0][path]) <= chain_rtol([BATCH // MICRO]), (name, path)
        # ZeRO gathers the whole state on rank 0
        assert_steps_match(runs, grads, ref, name, run.init_params(SPEC, seed=1))
