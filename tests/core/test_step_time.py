"""The step-time split (monitor.steptime): every trainer's forward / backward / optimizer / copy-wait seconds,
in its StepResult and in the loop's records, adding up to the step's time (CPU: perf_counter marks)."""
import pytest
import torch

from nanotrain.core import models
from nanotrain.monitor.tensorboard import tag_of
from nanotrain.core.train import loop
from tasks.demos.adapters import AutogradTrainer
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.stream.trainer import StreamConfig, StreamTrainer
from nanotrain.core.tree import named_leaves
from tests.core.test_trainer import ADAM, CFG, CPU32, _batches


def _trainer(kind):
    if kind == "resident":
        return ResidentTrainer(CFG, models.init_params(CFG, seed=1), TrainConfig(batch=8, micro_batch=2), ADAM, CPU32)
    if kind.startswith("streamed"):
        clip = 1.0 if kind.endswith("clipped") else None
        return StreamTrainer(CFG, models.init_params(CFG, seed=1), StreamConfig(batch=8, micro_batch=2, tail=1,
                                                                           clip_norm=clip), ADAM, CPU32)
    params = models.init_params(CFG, seed=1)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    return AutogradTrainer(params, lambda x, y: models.loss(params, x, y, CFG), torch.optim.AdamW(leaves), CFG,
                           clip_norm=1.0)


@pytest.mark.parametrize("kind", ["resident", "streamed", "streamed-clipped", "autograd"])
def test_the_split_is_recorded_and_adds_up_to_the_step(kind):
    trainer, batches = _trainer(kind), _batches(3)
    lcfg = loop.LoopConfig(steps=3, sequences_per_step=8, seq_len=16)
    records = loop.run(trainer, lambda: next(batches), lcfg, [], torch.device("cpu"))
    trainer.close()
    for r in records:
        parts = [r["forward_s"], r["backward_s"], r["optimizer_s"]] + ([r["copy_wait_s"]] if "copy_wait_s" in r
                                                                       else [])
        assert all(p >= 0 for p in parts) and r["forward_s"] > 0 and r["backward_s"] > 0 and r["optimizer_s"] > 0
        # The marks span the whole step but its first lines and its return: microseconds, though a loaded
        # CI machine can pre-empt the process there for milliseconds of a ~20 ms step; so a loose bound.
        assert 0.5 * r["step_s"] <= sum(parts) <= r["step_s"], r
        assert r["other_s"] == r["step_s"] - sum(parts)  # the loop's own sum, in the same order: equal
    assert ("copy_wait_s" in records[0]) == kind.startswith("streamed")  # the resident trainer folds them in
    assert {tag_of(k) for k in ("forward_s", "backward_s", "optimizer_s", "copy_wait_s", "other_s")} == {
        "time/forward_s", "time/backward_s", "time/optimizer_s", "time/copy_wait_s", "time/other_s"}
