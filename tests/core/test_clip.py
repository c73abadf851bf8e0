"""Gradient clipping by global norm against autograd + torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW,
with clipping triggered and not: the resident (offloaded) and streamed trainers, the autograd adapter (on GPT-2
and the Llama class), the pipeline, tensor parallelism."""
import math

import pytest
import torch

from nanotrain.core import models
from nanotrain.core.models import preset
from nanotrain.distributed import (GridConfig, close_distributed, init_distributed, launched_world_size, run_in_group,
                                   spawn)
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.pipeline import LayeredModel, build_pipeline, build_schedule
from tasks.demos.adapters import AutogradTrainer, PipelineTrainer
from nanotrain.core.train.clip import clip_, clip_factor
from nanotrain.core.train.resident import HandOver, ResidentTrainer, TrainConfig
from nanotrain.stream.trainer import StreamConfig, StreamTrainer
from nanotrain.core.tree import get_path, named_leaves
from tests.conftest import adam_bounds, chain_rtol, model_chain
from tests.core.test_trainer import ADAM, CFG, CPU32, LLAMA, _batches, _reference, assert_weights_match

STEPS = 4
NEVER, ALWAYS = 1e9, 0.05  # this model's gradient norms are ~1-3


def reference(max_norm, micro_batch=2, model=CFG):
    params, _, norms = _reference(STEPS, micro_batch, max_norm, model=model)
    return params, norms


KINDS = ["resident", "resident-exact-skip", "resident-states-on-device", "autograd", "streamed", "streamed-tail"]


# The Llama class through the trainers that walk its units (the autograd adapter runs whatever loss it is given).
@pytest.mark.parametrize("model,kind", [*((CFG, k) for k in KINDS), *((LLAMA, k) for k in KINDS if k != "autograd")],
                         ids=[*(f"gpt2-{k}" for k in KINDS), *(f"llama-{k}" for k in KINDS if k != "autograd")])
@pytest.mark.parametrize("max_norm", [NEVER, ALWAYS])
def test_clipped_training_equals_torch(kind, max_norm, model):
    ref, ref_norms = reference(max_norm, micro_batch=8 if kind == "autograd" else 2, model=model)
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
    results = [trainer.step(x, y) for x, y in _batches(STEPS, vocab=model.vocab_size)]
    assert [r.clipped for r in results] == [max_norm == ALWAYS] * STEPS
    for r, n in zip(results, ref_norms):
        assert r.grad_norm == pytest.approx(n, rel=1e-6)
    assert_weights_match(trainer.master_params(), ref, model=model)
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


PCFG = preset("tiny", n_layer=4, n_embd=32, n_head=4, n_ctx=16, vocab_size=256)
PIPE_NORM = 0.5


def _data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (8, 16), generator=g), torch.randint(0, 256, (8, 16), generator=g))
            for _ in range(3)]


def _pipeline_worker():
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(pp=launched_world_size()), "gloo", timeout_s=60)
    with ctx.guard():
        pipe = build_pipeline(ctx, LayeredModel.from_spec(PCFG, 16), build_schedule("1f1b", ctx.world_size, 4, 1),
                              _data()[0][0][:2], seed=0)
        trainer = PipelineTrainer(pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-3), 4, clip_norm=PIPE_NORM)
        results, grads = [], []  # each step's clipped gradients, as AdamW applied them
        for x, y in _data():
            results.append(trainer.step(x, y))
            grads.append({path: t.grad.clone() for path, t in pipe.named_parameters()})
        params = {path: t.detach().clone() for path, t in pipe.named_parameters()}
    close_distributed(ctx)
    times = [(r.forward_s, r.backward_s, r.optimizer_s, r.copy_wait_s) for r in results]  # monitor.steptime
    return [(r.loss, r.grad_norm, r.clipped) for r in results], params, times, grads


def test_pipeline_clips_by_the_norm_of_the_whole_model():
    per_rank = spawn(_pipeline_worker, 2, timeout_s=120, start_method="fork")
    params = models.init_params(PCFG, seed=0)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    opt = torch.optim.AdamW(leaves, lr=1e-3)
    start, want, ref_grads = {p: t.detach().clone() for p, t in named_leaves(params)}, [], []
    for x, y in _data():
        opt.zero_grad()
        loss = models.loss(params, x, y, PCFG)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(leaves, PIPE_NORM).item()
        ref_grads.append({path: t.grad.clone() for path, t in named_leaves(params)})
        opt.step()
        want.append((loss.item(), norm, norm > PIPE_NORM))
    assert any(c for _, _, c in want)
    loss_rtol, grad_rtol = (chain_rtol(model_chain(PCFG, 16, 8 * 16, what)) for what in ("loss", "grads"))
    hp = AdamConfig(lr=1e-3, weight_decay=0.01)  # torch.optim.AdamW's defaults
    # each weight within what AdamW makes of the clipped gradients each side applied, each loss within the chain's
    # bound plus what that moves it over both ranks' stages (conftest.adam_bounds); the norms after a step: 1e-5,
    # not derived
    bounds = [adam_bounds({p: start[p] for p in got}, grads, ref_grads, hp) for _, got, _, grads in per_rank]
    moved = [sum(m[s] for _, m in bounds) for s in range(len(want))]
    for (results, got, times, _), (aparts, _) in zip(per_rank, bounds):
        assert all(t > 0 for step in times for t in step)  # the split: forward, backward, optimizer, waits
        for s, ((loss, norm, clipped), (wl, wn, wc)) in enumerate(zip(results, want)):
            assert abs(loss - wl) <= loss_rtol * wl + moved[s] and clipped == wc, (s, loss, wl)
            # the first norm: |‖a‖ - ‖b‖| <= ‖a - b‖, the gradients' bound
            assert norm == pytest.approx(wn, rel=1e-5 if s else grad_rtol), (s, norm, wn)
        for path, t in got.items():
            over = ((t - get_path(params, path).detach()).abs().reshape(-1) / aparts[path][-1]).max()
            assert over <= 1, f"{path}: {over:.2f} times its bound"


TCFG = preset("tiny", n_layer=2, n_embd=48, n_head=6, vocab_size=251, n_ctx=32)  # uneven heads, padded vocabulary
TP_NORM = 0.5
U = 2.0 ** -24  # fp32's unit roundoff
GRAD_RTOL = 160 * U  # ~1e-5, derived in test_tensor_parallel_clips_by_the_norm_of_the_whole_model
STEP_TOL = 8 * U     # per element, in units of |p| + lr: the rounding of one fp32 AdamW update


def _tp_worker(rank, world):
    """Each rank checks its shards against the single-process step in float64, clipped by torch, sharded the
    same way: the norm and the clipped gradients, then each weight against float64 AdamW from the same start
    and this rank's clipped gradient."""
    from nanotrain.distributed import GridConfig as TPGrid, build_grid
    from nanotrain.tensor_parallel import grad_norm, parallel_loss, plan_tp, shard_params, sync_grads
    from nanotrain.core.tree import tree_map
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 251, (4, 16), generator=g), torch.randint(0, 251, (4, 16), generator=g)
    full = tree_map(torch.Tensor.double, models.init_params(TCFG, seed=0))
    leaves = [t.requires_grad_() for _, t in named_leaves(full)]
    models.loss(full, x, y, TCFG).backward()
    norm = torch.nn.utils.clip_grad_norm_(leaves, TP_NORM).item()
    grid = build_grid(TPGrid(tp=world))
    out = {"norm": norm}
    for sp in (False, True):
        plan = plan_tp(TCFG, grid, sequence_parallel=sp)
        local = tree_map(lambda t: t.requires_grad_(), shard_params(models.init_params(TCFG, seed=0), plan))
        trainer = AutogradTrainer(local, lambda a, b: parallel_loss(local, a, b, plan),
                                  torch.optim.AdamW([t for _, t in named_leaves(local)]),
                                  after_backward=lambda: sync_grads(local, plan), clip_norm=TP_NORM,
                                  norm_fn=lambda: grad_norm(local, plan))
        result = trainer.step(x, y)
        want = dict(named_leaves(shard_params(tree_map(lambda t: t.grad, full), plan)))
        start = named_leaves(shard_params(tree_map(torch.Tensor.double, models.init_params(TCFG, seed=0)), plan))
        grad_err, step_err = 0.0, 0.0
        for (path, t), (_, p0) in zip(named_leaves(local), start):
            grad_err = max(grad_err, ((t.grad.double() - want[path]).norm() / want[path].norm()).item())
            p1 = p0.clone().requires_grad_()
            p1.grad = t.grad.double()
            torch.optim.AdamW([p1]).step()  # lr 1e-3, as the trainer's
            step_err = max(step_err, ((t.detach() - p1.detach()).abs() / (p0.abs() + 1e-3)).max().item())
        out[sp] = (result.grad_norm, result.clipped, grad_err, step_err)
    return out


def test_tensor_parallel_clips_by_the_norm_of_the_whole_model():
    """The bounds, from the computation rather than one machine's kernels.

    Gradients and norm (``GRAD_RTOL``, against float64): each gradient element comes out of a chain of about ten
    fp32 reductions (forward and backward through two blocks and the head), none longer than 256 terms (vocabulary
    251, MLP 192, batch x sequence 64). A reduction of n terms rounds to ~sqrt(n) u in norm (u = 2^-24, errors of
    either sign), so at most 16 u; ten of them added up: 160 u, about 1e-5, whatever order a CPU's kernels or thread
    count sum in (measured: 3.9e-7 on an AMD EPYC, 4.5e-7 on a Xeon with AVX-512). The norm is within it too, as
    |‖a‖ - ‖b‖| ≤ ‖a - b‖. A clip factor 1% off, or a shard that missed a reduction, is 1e-2 and more.

    Weights (``STEP_TOL``): AdamW is elementwise, so against float64 AdamW from the same start and this rank's
    clipped gradient, all that differs is fp32's rounding of one update: 3 u of |p| (the decay factor, its product,
    the final add) and about 8 u of the update, at most lr (the moments 3 u, the denominator's sqrt, division and
    eps 3 u, the step's division and product 2 u): 8 u (|p| + lr) (measured: 4.5 u and 5.0 u). A lost update is off
    by lr, 1e5 times the bound. (Against the reference's weights instead, the first Adam step lr g / (|g| + eps)
    would turn a rounding of the gradient in an element with |g| near eps into up to 2 lr, a sign flip: the check of
    the gradients above is where summation order belongs.)
    """
    for out in spawn(run_in_group, 2, ("gloo", _tp_worker), timeout_s=120, start_method="fork"):
        assert out["norm"] > TP_NORM
        for sp in (False, True):
            norm, clipped, grad_err, step_err = out[sp]
            assert norm == pytest.approx(out["norm"], rel=GRAD_RTOL) and clipped, sp
            assert grad_err <= GRAD_RTOL, (sp, grad_err)
            assert step_err <= STEP_TOL, (sp, step_err / U)


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
