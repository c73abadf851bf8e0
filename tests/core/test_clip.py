"""Gradient clipping by global norm against autograd + torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW,
with clipping triggered and not: the resident (offloaded) and streamed trainers, the autograd adapter (on GPT-2
and the Llama class). Across ranks (the pipeline, tensor parallelism): ``test_clip_ranks``."""
import math

import pytest
import torch

from nanotrain.core import models
from nanotrain.core.optim import OffloadConfig
from tasks.demos.adapters import AutogradTrainer
from nanotrain.core.train.clip import clip_, clip_factor
from nanotrain.core.train.resident import HandOver, ResidentTrainer, TrainConfig
from nanotrain.stream.trainer import StreamConfig, StreamTrainer
from nanotrain.core.tree import named_leaves
from tests.conftest import assert_norms, chain_rtol, model_chain, unclipped_apart
from tests.core.test_trainer import (ADAM, CFG, CPU32, LLAMA, _batches, _reference, applied_grads,
                                     assert_adam_run)

STEPS = 4
NEVER, ALWAYS = 1e9, 0.05  # this model's gradient norms are ~1-3


KINDS = ["resident", "resident-exact-skip", "resident-states-on-device", "autograd", "streamed", "streamed-tail"]


# The Llama class through the trainers that walk its units (the autograd adapter runs whatever loss it is given).
@pytest.mark.parametrize("model,kind", [*((CFG, k) for k in KINDS), *((LLAMA, k) for k in KINDS if k != "autograd")],
                         ids=[*(f"gpt2-{k}" for k in KINDS), *(f"llama-{k}" for k in KINDS if k != "autograd")])
@pytest.mark.parametrize("max_norm", [NEVER, ALWAYS])
def test_clipped_training_equals_torch(monkeypatch, kind, max_norm, model):
    """The clip factor comes from a norm over every leaf, so its rounding (another order of that sum on another
    CPU or thread count) scales every gradient, and Adam's first step turns a gradient's rounding near eps into up
    to lr: each weight is bounded by what AdamW makes of the clipped gradients each side applied
    (``test_trainer.assert_adam_run``), the norms by the distance of those gradients (``conftest.assert_norms``)."""
    micro = 8 if kind == "autograd" else 2
    ref, ref_losses, ref_norms = _reference(STEPS, micro, max_norm, model=model, grads=(ref_grads := []))
    applied = applied_grads(monkeypatch, kind)
    if kind.startswith("streamed"):  # deferred updates (train.deferred), host boundaries and a tail too
        scfg = StreamConfig(batch=8, micro_batch=2, on_host=1, tail=1 if kind.endswith("tail") else 0,
                            clip_norm=max_norm)
        trainer = StreamTrainer(model, models.init_params(model, seed=1), scfg, ADAM, CPU32)
    elif kind.startswith("resident"):
        # exact_skip (also with the states on the device): speculative updates, redone when clipped
        ocfg = OffloadConfig(device="cpu", dtype=torch.float32, exact_skip=kind != "resident",
                             offload=kind != "resident-states-on-device")
        trainer = ResidentTrainer(model, models.init_params(model, seed=1), TrainConfig(batch=8, micro_batch=2,
                                                                                     clip_norm=max_norm), ADAM, ocfg)
        assert (trainer.weights.hand_over is HandOver.SPECULATIVE) == (kind != "resident")
    else:
        params = models.init_params(model, seed=1)
        leaves = [t.requires_grad_() for _, t in named_leaves(params)]
        opt = torch.optim.AdamW(leaves, lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps, weight_decay=ADAM.weight_decay,
                                foreach=False)
        trainer = AutogradTrainer(params, lambda x, y: models.loss(params, x, y, model), opt, model,
                                  clip_norm=max_norm)
    results = []
    for x, y in _batches(STEPS, vocab=model.vocab_size):
        applied.append({})
        results.append(trainer.step(x, y))
        if kind == "autograd":  # clipped in place before torch's AdamW read them
            applied[-1] = {path: t.grad.clone() for path, t in named_leaves(params)}
    assert [r.clipped for r in results] == [max_norm == ALWAYS] * STEPS
    norms, sizes = [r.grad_norm for r in results], [g.numel() for g in ref_grads[0].values()]
    apart = unclipped_apart(applied, ref_grads, norms, ref_norms, max_norm)
    assert_norms(norms, ref_norms, apart, chain_rtol(model_chain(model, 16, 8 * 16)), sizes)
    assert_adam_run(trainer.master_params(), ref, ([r.loss for r in results], applied), (ref_losses, ref_grads),
                    model)
    trainer.close()


def test_speculative_clipping_hands_units_over_during_backward(monkeypatch):
    """The overlap is kept: every unit is handed over from its gradient hook, inside backward, and a step
    that clips is redone once after it; one that does not is not."""
    import inspect

    import nanotrain.core.train.resident as resident

    events = []
    monkeypatch.setattr(resident, "redo", lambda *a, real=resident.redo: (events.append("redo"), real(*a)))
    ocfg = OffloadConfig(device="cpu", dtype=torch.float32, exact_skip=True)
    for max_norm, redone in ((ALWAYS, True), (NEVER, False)):
        trainer = ResidentTrainer(CFG, models.init_params(CFG, seed=1), TrainConfig(batch=8, micro_batch=2,
                                                                                 clip_norm=max_norm), ADAM, ocfg)
        ready = trainer.opt.update
        monkeypatch.setattr(trainer.opt, "update", lambda unit, grads: (
            events.append(any(f.function == "_on_grad" for f in inspect.stack())), ready(unit, grads)))
        events.clear()
        trainer.step(*next(_batches(1)))
        assert events == [True] * len(trainer.weights.units) + (["redo"] if redone else [])
        trainer.close()


def test_streamed_non_finite_norm_applies_nothing():
    """An inf in the last block's gradient, after the blocks above were kept: the deferred step applies nothing."""
    trainer = StreamTrainer(CFG, models.init_params(CFG, seed=1), StreamConfig(batch=8, micro_batch=2, clip_norm=1.0),
                            ADAM, CPU32)
    final = trainer._final_block

    def poisoned(i, slot):
        if i == 0:
            trainer.block_grads[0].view(-1)[0] = float("inf")
        final(i, slot)

    trainer._final_block = poisoned
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    result = trainer.step(*next(_batches(1)))
    assert result.skipped and math.isinf(result.grad_norm)
    after = trainer.state_dict()
    assert int(after["skipped_steps"]) == 1 and int(after["steps"]) == 0
    assert all(torch.equal(after[k], v) for k, v in before.items() if k != "skipped_steps")
    trainer._final_block = final
    assert not trainer.step(*next(_batches(1))).skipped and trainer.opt.steps == 1
    trainer.close()


def test_a_non_finite_norm_skips_the_whole_step():
    grads = [torch.ones(3), torch.tensor([1.0, float("inf")])]
    norm = clip_(grads, 1.0)
    assert math.isinf(norm) and all(torch.isnan(g).all() for g in grads)
    assert clip_factor(torch.tensor(0.5), 1.0) == 1.0
    # One inf in the embeddings' gradient, handed over last: without the NaN factor the units before
    # it would be updated with zeroed gradients and the in-place optimizer could not undo the step.
    trainer = ResidentTrainer(CFG, models.init_params(CFG, seed=1), TrainConfig(batch=8, micro_batch=2, clip_norm=1.0),
                              ADAM, CPU32)
    hand_over = trainer.weights._clip_and_hand_over

    def poisoned(max_norm):
        trainer.weights.accum["wte"][0, 0] = float("inf")
        return hand_over(max_norm)

    trainer.weights._clip_and_hand_over = poisoned
    before = {p: t.clone() for p, t in named_leaves(trainer.master_params())}
    result = trainer.step(*next(_batches(1)))
    trainer.opt.synchronize()
    assert math.isinf(result.grad_norm) and result.skipped
    assert trainer.opt.skipped_steps == 1 and trainer.opt.steps == 0
    assert all(torch.equal(before[p], t) for p, t in named_leaves(trainer.master_params()))
    trainer.close()


@pytest.mark.parametrize("clip_norm", [None, 1.0])
def test_the_autograd_adapter_skips_a_non_finite_step(clip_norm):
    params = models.init_params(CFG, seed=1)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    trainer = AutogradTrainer(params, lambda x, y: models.loss(params, x, y, CFG) * float("nan"),
                              torch.optim.AdamW(leaves), CFG, clip_norm=clip_norm)
    before = [t.detach().clone() for t in leaves]
    assert trainer.step(*next(_batches(1))).skipped and trainer.step_count == 1
    assert all(torch.equal(a, b) for a, b in zip(before, leaves))


def test_finetune_clips_with_overlap_and_streamed(offline_files, tmp_path, monkeypatch):
    """tasks.finetune --clip-norm: resident with --clip-overlap (speculative) and streamed (deferred) on the CPU."""
    import json

    from tasks.finetune import main
    from tests.conftest import SHAKESPEARE, TOKENIZER_DIR

    monkeypatch.chdir(tmp_path)
    common = ["--model", "tiny", "--batch", "4", "--micro-batch", "2", "--seq", "32", "--steps", "2", "--data",
              str(SHAKESPEARE), "--tokenizer-dir", str(TOKENIZER_DIR), "--clip-norm", "0.5", "--no-tensorboard"]
    for out, extra in (("overlap", ["--clip-overlap"]), ("streamed", ["--stream"])):
        main(common + ["--out", out] + extra)
        rows = [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        assert [r["clipped"] for r in rows] == [True, True] and all(r["forward_s"] > 0 for r in rows)
    with pytest.raises(SystemExit):
        main(common[:-3] + ["--clip-overlap", "--out", "bad"])
