"""LoRA under DDP and ZeRO-1/2 on 2 and 3 CPU processes reproduces one process on the same global batch (fp32):
every step's loss and, after 3 AdamW steps, the pairs' masters and both moments within 1e-6 relative (the bound of
``test_data_parallel``: the same sums over ranks instead of micro-batches, a few 2^-24 each). The frozen base is
every rank's own copy, outside the optimizer: only the pairs' gradients are reduced (and their state sharded).
One forked world per size runs every configuration."""
from __future__ import annotations

import pytest
import torch

from nanotrain.core.models import model_spec, preset, run
from nanotrain.core.models.lora import LoraConfig, with_lora
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from tests.conftest import rel_err

SPEC = with_lora(model_spec(preset("tiny-llama")), LoraConfig(4, 8.0, ("q", "v", "down"), dropout=0.1))
ADAM = AdamConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CPU32 = OffloadConfig(device="cpu", dtype=torch.float32)
TCFG = TrainConfig(batch=12, micro_batch=2, recompute="every")
RUNS = {"ddp": DPConfig(zero=0, bucket_mb=0.01), "zero1": DPConfig(zero=1), "zero2": DPConfig(zero=2, bucket_mb=0)}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(3):
        x = torch.randint(0, SPEC.vocab_size, (12, 16), generator=g)
        y = x.roll(-1, dims=1)
        y[:, -3:] = -100
        out.append((x, y))
    return out


def steps(trainer) -> dict:
    losses = [trainer.step(x, y).loss for x, y in batches()]
    state = {k: v.clone() for k, v in trainer.state_dict().items()}
    trainer.close()
    return {"losses": losses, "state": state}


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
    ref = steps(ResidentTrainer(SPEC, run.init_params(SPEC, seed=1), TCFG, ADAM, CPU32))
    per_rank = spawn(worker, world, (), start_method="fork", timeout_s=120)
    for name in RUNS:
        for r in per_rank:
            for a, b in zip(r[name]["losses"], ref["losses"]):
                assert abs(a - b) <= 1e-6 * abs(b), name
        state = per_rank[0][name]["state"]  # ZeRO gathers the whole state on rank 0
        assert set(state) == set(ref["state"]), name
        for key, b in ref["state"].items():
            assert (int(state[key]) == int(b)) if key in ("steps", "skipped_steps") else \
                rel_err(state[key], b) <= 1e-6, (name, key)
