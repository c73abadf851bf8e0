"""Packed rows through the resident and the streamed trainers: one step's loss and every gradient equal those of
the batch's documents run one by one (``tests.packed_cases``: bound and reference). The gradient is read from Adam's
first moment after the first step with beta1 = 0 (the moment is then the gradient itself, exactly)."""
from __future__ import annotations

import pytest
import torch

from nanotrain.core.models import init_params, model_spec, preset
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.stream.config import StreamConfig
from nanotrain.stream.trainer import StreamTrainer
from tests.conftest import rel_err
from tests.packed_cases import one_by_one, packed_batch, packed_rtol

MODELS = {"gpt2": preset("tiny", n_layer=3, vocab_size=128), "llama": preset("tiny-llama", n_layer=3)}
ADAM = AdamConfig(lr=1e-3, betas=(0.0, 0.95), eps=1e-8, weight_decay=0.0)
CPU32 = OffloadConfig(device="cpu", dtype=torch.float32, offload=True, state_bits=32)
ROWS = 4


def check_step(trainer, spec, batch) -> None:
    want_loss, want = one_by_one(spec, init_params(spec, seed=1), *batch)
    loss_rtol, grad_rtol = packed_rtol(spec, batch[0], "loss"), packed_rtol(spec, batch[0])
    assert abs(trainer.eval_loss(*batch) - want_loss) <= loss_rtol * want_loss
    result = trainer.step(*batch)
    assert abs(result.loss - want_loss) <= loss_rtol * want_loss
    state = trainer.state_dict()
    for path, g in want.items():  # the first moment, with beta1 0: the gradient itself
        assert rel_err(state[f"exp_avg.{path}"], g) <= grad_rtol, path
    trainer.close()


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("recompute", ["none", "every", "lean"])
def test_resident_trainer_on_packed_rows(name, recompute):
    spec = model_spec(MODELS[name])
    trainer = ResidentTrainer(spec, init_params(spec, seed=1), TrainConfig(batch=ROWS, micro_batch=2,
                                                                           recompute=recompute), ADAM, CPU32)
    check_step(trainer, spec, packed_batch(spec.vocab_size, rows=ROWS))


@pytest.mark.parametrize("name", list(MODELS))
def test_streamed_trainer_on_packed_rows(name):
    """Layer-major blocks, a tail of one block run with the head one row at a time (its documents split with it)."""
    spec = model_spec(MODELS[name])
    scfg = StreamConfig(batch=ROWS, micro_batch=2, tail=1, tail_micro_batch=1)
    check_step(StreamTrainer(spec, init_params(spec, seed=1), scfg, ADAM, CPU32), spec,
               packed_batch(spec.vocab_size, rows=ROWS))
