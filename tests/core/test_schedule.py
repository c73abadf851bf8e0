"""Learning-rate schedules: nanoGPT's formula step by step, and every trainer under a schedule equal to
plain autograd + torch.optim.AdamW given the same per-step rate."""
import math

import pytest
import torch

from nanotrain.core import models
from nanotrain.data import DataPosition
from nanotrain.core.train import loop
from tasks.demos.adapters import AutogradTrainer
from nanotrain.core.train.loop import LoopConfig
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.core.train.schedule import LRSchedule
from nanotrain.checkpoint.resume import saved_schedule
from nanotrain.checkpoint.state import save_checkpoint
from nanotrain.stream.trainer import StreamConfig, StreamTrainer
from nanotrain.core.tree import named_leaves
from tests.core.test_trainer import ADAM, CFG, CPU32, _batches, applied_grads, assert_adam_run
from tests.core.test_trainer import _reference as reference


def nanogpt_lr(it, lr, warmup, decay, min_lr):
    """nanoGPT's ``get_lr`` (train.py), as written there."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay:
        return min_lr
    ratio = (it - warmup) / (decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def test_each_step_follows_the_formula():
    cos = LRSchedule(6e-4, "cosine", warmup_steps=10, decay_steps=100, min_lr=6e-5)
    lin = LRSchedule(6e-4, "linear", warmup_steps=10, decay_steps=100, min_lr=6e-5)
    const = LRSchedule(6e-4, "constant", warmup_steps=3)
    for it in range(120):
        assert cos.lr_at(it) == nanogpt_lr(it, 6e-4, 10, 100, 6e-5)  # the same float64 operations in one order
        want = 6e-4 * (it + 1) / 11 if it < 10 else max(6e-5, 6e-4 - (it - 10) / 90 * (6e-4 - 6e-5))
        # other float64 operations: each side's (at most five) on terms of at most lr round by 2^-53 of lr each,
        # and the result is at least min_lr = lr / 10
        assert lin.lr_at(it) == pytest.approx(want, rel=2 * 5 * 10 * 2.0 ** -53, abs=0), it
        assert const.lr_at(it) == (6e-4 * (it + 1) / 4 if it < 3 else 6e-4)
    assert cos.lr_at(0) > 0 and cos.lr_at(10) == 6e-4 and cos.lr_at(100) == cos.lr_at(500) == 6e-5
    assert LRSchedule(1e-3).lr_at(0) == 1e-3


def test_bad_schedules_are_named():
    with pytest.raises(ValueError, match=r"unknown lr schedule 'cosin' \(known: constant, cosine, linear\)"):
        LRSchedule(1e-3, "cosin")
    with pytest.raises(ValueError, match="decay steps .* above the warm-up"):
        LRSchedule(1e-3, "cosine", warmup_steps=10, decay_steps=10)
    with pytest.raises(ValueError, match="min lr"):
        LRSchedule(1e-3, "linear", decay_steps=10, min_lr=1e-2)


SCHEDULE = LRSchedule(ADAM.lr, "cosine", warmup_steps=2, decay_steps=5, min_lr=ADAM.lr / 10)
STEPS = 6


def _reference(micro_batch=2, grads=None):
    """Plain autograd, the same micro-batches, torch's AdamW with each step's rate set by hand: the weights and
    each step's loss (its gradients appended to ``grads``)."""
    return reference(STEPS, micro_batch, lr_at=lambda step: nanogpt_lr(step, ADAM.lr, 2, 5, ADAM.lr / 10),
                     grads=grads)[:2]


def _autograd_trainer():
    params = models.init_params(CFG, seed=1)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    opt = torch.optim.AdamW(leaves, lr=123.0, betas=ADAM.betas, eps=ADAM.eps, weight_decay=ADAM.weight_decay,
                            foreach=False)
    return AutogradTrainer(params, lambda x, y: models.loss(params, x, y, CFG), opt, CFG)


@pytest.mark.parametrize("kind", ["resident", "streamed", "autograd"])
def test_trainers_under_a_schedule_equal_torch_adamw_with_the_same_rates(monkeypatch, kind):
    """Each weight within what AdamW makes of the gradients each side applied, each loss within the chain's bound
    plus what that moves it (``test_trainer.assert_adam_run``: at ``ADAM.lr``, the schedule's peak, a bound for
    every step's rate, as each step's term grows with its rate)."""
    ref, ref_losses = _reference(micro_batch=8 if kind == "autograd" else 2, grads=(ref_grads := []))
    hp = ADAM.__class__(lr=123.0, betas=ADAM.betas, eps=ADAM.eps, weight_decay=ADAM.weight_decay)  # overridden
    if kind == "resident":
        trainer = ResidentTrainer(CFG, models.init_params(CFG, seed=1), TrainConfig(batch=8, micro_batch=2), hp, CPU32)
    elif kind == "streamed":
        trainer = StreamTrainer(CFG, models.init_params(CFG, seed=1), StreamConfig(batch=8, micro_batch=2), hp, CPU32)
    else:
        trainer = _autograd_trainer()
    applied, step = applied_grads(monkeypatch, kind), trainer.step

    def recorded(x, y):
        applied.append({})
        result = step(x, y)
        if kind == "autograd":  # torch's AdamW read its leaves' gradients
            applied[-1] = {path: t.grad.clone() for path, t in named_leaves(trainer.params)}
        return result

    trainer.step = recorded
    batches = _batches(STEPS)
    records = loop.run(trainer, lambda: next(batches), LoopConfig(STEPS, 8, 16, schedule=SCHEDULE), [],
                       torch.device("cpu"))
    assert [r["lr"] for r in records] == [SCHEDULE.lr_at(s) for s in range(STEPS)]
    assert_adam_run(trainer.master_params(), ref, ([r["loss"] for r in records], applied), (ref_losses, ref_grads))
    trainer.close()


def test_checkpoints_keep_the_schedule(tmp_path):
    trainer = ResidentTrainer(CFG, models.init_params(CFG, seed=1), TrainConfig(batch=8, micro_batch=8), ADAM, CPU32)
    ckpt = save_checkpoint(tmp_path, trainer, DataPosition(), {}, SCHEDULE)
    assert saved_schedule(ckpt) == SCHEDULE
    assert saved_schedule(save_checkpoint(tmp_path / "old", trainer, DataPosition())) is None
    trainer.close()


def test_a_resumed_run_keeps_its_schedule_unless_its_settings_change(capsys):
    """A longer --steps does not stretch the decay (said, with the flag that would); the same settings say
    nothing; a changed --lr (allowed by then) is the schedule the run follows, and says so."""
    from argparse import Namespace

    from nanotrain.run.folder import resumed_schedule

    def args(**changes):  # the saved run's settings, as --resume restores them (--decay-steps, --min-lr derived)
        return Namespace(**{"lr": ADAM.lr, "lr_schedule": "cosine", "warmup_steps": 2, "decay_steps": None,
                            "min_lr": None, "steps": 5, **changes})

    assert resumed_schedule(args(), SCHEDULE, 3) == SCHEDULE and capsys.readouterr().out == ""
    assert resumed_schedule(args(steps=50), SCHEDULE, 5) == SCHEDULE
    stretched = LRSchedule(ADAM.lr, "cosine", 2, 50, ADAM.lr / 10).lr_at(5)
    assert capsys.readouterr().out == (f"note: the run's cosine decay ends at step 5, so steps 6-50 train at its "
                                       f"floor, lr {ADAM.lr / 10:g}; to decay over the longer run instead, add "
                                       f"--decay-steps 50 --allow-changes (lr {stretched:.3g} at step 5, then down "
                                       f"to {ADAM.lr / 10:g} at step 50)\n")
    assert resumed_schedule(args(steps=50, decay_steps=50), SCHEDULE, 5).decay_steps == 50  # given: followed
    assert capsys.readouterr().out.startswith(f"lr schedule from step 5: lr {ADAM.lr:g}: 2 warm-up steps, then cosine "
                                              f"decay to {ADAM.lr / 10:g} at step 50 (the run's was ")
    changed = resumed_schedule(args(lr=ADAM.lr / 2), SCHEDULE, 3)
    assert changed == LRSchedule(ADAM.lr / 2, "cosine", 2, 5, ADAM.lr / 20)
    assert capsys.readouterr().out.startswith(f"lr schedule from step 3: {changed.describe()} (the run's was ")
    constant = LRSchedule(ADAM.lr, "constant", 0, 5, ADAM.lr / 10)
    assert resumed_schedule(args(lr_schedule="constant", warmup_steps=0, steps=9), constant, 5) == constant
    assert capsys.readouterr().out == ""  # a constant rate: nothing to say however long the run


def test_a_resumed_finetune_follows_the_uninterrupted_curve(offline_files, tmp_path, monkeypatch):
    from tests.conftest import SHAKESPEARE, TOKENIZER_DIR

    import json

    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    base = ["--model", "tiny", "--batch", "4", "--micro-batch", "2", "--seq", "32", "--data", str(SHAKESPEARE),
            "--tokenizer-dir", str(TOKENIZER_DIR), "--lr", "1e-3", "--lr-schedule", "cosine", "--warmup-steps", "1",
            "--no-tensorboard"]
    main(base + ["--steps", "4", "--out", "whole"])
    main(base + ["--steps", "2", "--decay-steps", "4", "--out", "parts"])
    main(base + ["--steps", "4", "--out", "parts", "--resume"])  # --decay-steps left out: the saved one holds

    def rows(run):
        return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    whole, parts = rows("whole"), rows("parts")
    assert [r["lr"] for r in parts] == [r["lr"] for r in whole]
    # bit for bit: both runs are this process's kernels (one instruction set, one thread count) on the same data
    # from the same state, the resume restoring fp32 masters, moments and step counts exactly; any difference is
    # state the checkpoint lost or altered, not a reordered sum
    assert [r["loss"] for r in parts] == [r["loss"] for r in whole]
