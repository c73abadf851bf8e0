"""Packed rows under data parallelism (2 and 3 CPU ranks; DDP, ZeRO-3, and the streamed trainer's ZeRO-Offload):
each rank's rows take their positions with them; one step's loss and every reduced gradient equal those of the
global batch's documents run one by one (``tests.packed_cases``: bound and reference; the gradient is Adam's first
moment with beta1 = 0). One forked world per size runs every check."""
from __future__ import annotations

import pytest
import torch

from nanotrain.core.models import init_params, model_spec, preset
from nanotrain.core.train.resident import TrainConfig
from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from nanotrain.stream.config import StreamConfig
from nanotrain.stream.zero_offload import zero_offload_trainer
from tests.conftest import rel_err
from tests.core.test_packing_trainers import ADAM, CPU32
from tests.packed_cases import one_by_one, packed_batch, packed_rtol

SPECS = {"gpt2": model_spec(preset("tiny", n_layer=2, vocab_size=128)),
         "llama": model_spec(preset("tiny-llama", n_layer=2))}
ROWS = 6
RUNS = {"ddp": (TrainConfig(batch=ROWS, micro_batch=1), DPConfig(zero=0)),
        "zero3": (TrainConfig(batch=ROWS, micro_batch=1, recompute="every"), DPConfig(zero=3)),
        "streamed": (StreamConfig(batch=ROWS, micro_batch=1), DPConfig(zero=2))}


def worker() -> dict:
    import torch.distributed as dist
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "gloo", timeout_s=60)
    out = {}
    try:
        for name, spec in SPECS.items():
            batch = packed_batch(spec.vocab_size, rows=ROWS)
            for run_name, (tcfg, dcfg) in RUNS.items():
                build = zero_offload_trainer if isinstance(tcfg, StreamConfig) else data_parallel_trainer
                trainer = build(spec, init_params(spec, seed=1), tcfg, ADAM, CPU32, dcfg, dist.group.WORLD)
                evaluated = trainer.eval_loss(*batch)
                loss = trainer.step(*batch).loss
                state = trainer.state_dict()
                out[(name, run_name)] = (evaluated, loss, {k: v.clone() for k, v in state.items()
                                                           if k.startswith("exp_avg.")})
                trainer.close()
    finally:
        close_distributed(ctx)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_on_packed_rows(world):
    per_rank = spawn(worker, world, timeout_s=240, start_method="fork")
    for name, spec in SPECS.items():
        batch = packed_batch(spec.vocab_size, rows=ROWS)
        want_loss, want = one_by_one(spec, init_params(spec, seed=1), *batch)
        loss_rtol, grad_rtol = packed_rtol(spec, batch[0], "loss"), packed_rtol(spec, batch[0])
        for run_name in RUNS:
            evaluated, loss, moments = per_rank[0][(name, run_name)]
            assert abs(evaluated - want_loss) <= loss_rtol * want_loss, (name, run_name)
            assert abs(loss - want_loss) <= loss_rtol * want_loss, (name, run_name)
            for path, g in want.items():  # the first moment, with beta1 0: the gradient itself
                assert rel_err(moments[f"exp_avg.{path}"], g) <= grad_rtol, (name, run_name, path)
