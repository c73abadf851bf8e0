"""Clipping and fp16 with weight streaming under data parallelism (``--stream --dp``, ``stream/sharded_deferred.py``)
at 2 and 3 CPU ranks, a block input in host memory and a tail block.

Clipping (fp32): against plain autograd on the whole batch + ``torch.nn.utils.clip_grad_norm_`` +
``torch.optim.AdamW`` (``tests.core.test_trainer._reference``), clipping triggered on every step and on none:
the clip flags; from the clipped gradients each side's AdamW applied, the masters after 3 steps and every step's
loss (``test_trainer.assert_adam_run``) and norm (``conftest.assert_norms``).

fp16: against ``torch.amp.GradScaler`` + AdamW (``tests.core.test_fp16._reference``) over steps that overflow,
back off and grow the scale, with and without clipping: the scales and skips step for step, each loss that of
the masters its step started from, the weights within the single-process streamed fp16 test's bounds
(``tests/core/test_fp16.py`` says why).
Then an overflow injected into one rank's data: every rank skips that one step with nothing applied
(its shard of masters and moments bit for bit), halves its scale and applies the next; the replicas
stay equal throughout. So does a single inf on one rank, which the reduction puts into one rank's
shard only (the all-reduced norm makes every rank skip). A sharded checkpoint keeps the scale: the resumed
run's next step is the uninterrupted one's, bit for bit.

One forked world per size runs every check.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nanotrain.core.models import init_params, model_spec, preset, run
from nanotrain.data_parallel import DPConfig
from nanotrain.stream.zero_offload import zero_offload_trainer
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from nanotrain.core.optim import OffloadConfig
from nanotrain.core.train.scaler import LossScaler, ScalerConfig
from nanotrain.core.train.step import masters_tree
from nanotrain.stream.trainer import StreamConfig
from tests.core import test_fp16 as fp16
from tests.conftest import assert_norms, chain_rtol, model_chain, unclipped_apart
from tests.core.test_trainer import ADAM, CFG, CPU32, _batches, _reference, assert_adam_run
from tests.stream.test_data_parallel_streamed import applied, split, spy_updates
from tests.data_parallel.test_data_parallel_clip_fp16 import assert_own_losses, steps_from

BATCH, STEPS, FP16_STEPS = 12, 3, 8
NEVER, ALWAYS = 1e9, 0.05  # this model's gradient norms are ~1-3
SCALER = ScalerConfig(init_scale=2.0 ** 20, growth_interval=3)  # overflows the first steps, then grows
FP16 = OffloadConfig(device="cpu", dtype=torch.float16)
FP16_RUNS = ((None, 0), (0.5, 1))  # (clip, tail), as tests/core/test_fp16.py's streamed test


def _trainer(cfg, ocfg, clip_norm=None, tail=1, check=False):
    scfg = StreamConfig(batch=BATCH, micro_batch=2, on_host=1, tail=tail, clip_norm=clip_norm)
    return zero_offload_trainer(cfg, init_params(cfg, seed=1), scfg, fp16.ADAM if cfg is fp16.CFG else ADAM,
                                ocfg, DPConfig(check_replicas=check), dist.group.WORLD)


def _masters(trainer):
    state = trainer.state_dict()  # collective; the whole state on the first rank only
    return masters_tree(trainer.cfg, {k: t.clone() for k, t in state.items()}) if state else None


def clipped_run(max_norm) -> dict:
    trainer, seen, marks = _trainer(CFG, CPU32, max_norm, check=True), [], []
    spy_updates(trainer.opt.inner, seen)  # each update's clipped gradients, as this rank's AdamW applied them
    results = [(marks.append(len(seen)), trainer.step(x, y))[1] for x, y in _batches(STEPS, BATCH)]
    out = {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
           "clipped": [r.clipped for r in results], "skipped": [r.skipped for r in results],
           "masters": _masters(trainer), "grads": split(seen, marks), "pieces": trainer.opt.pieces}
    trainer.close()
    return out


def fp16_run(clip, tail) -> dict:
    trainer = _trainer(fp16.CFG, FP16, clip, tail)
    trainer.inner.scaler = LossScaler(SCALER)
    results, before = steps_from(trainer, _masters)
    out = {"losses": [r.loss for r in results], "scales": [r.loss_scale for r in results],
           "skipped": [r.skipped for r in results], "overflow": [r.overflow for r in results],
           "counts": (trainer.opt.steps, trainer.opt.skipped_steps), "masters": _masters(trainer), "before": before}
    trainer.close()
    return out


def injected_overflow(bad_rank) -> dict:
    """Step 2's loss on ``bad_rank`` only is multiplied by 1e6: its scaled fp16 gradients overflow (the loss
    stays finite, so only the deferred step's norm can tell)."""
    trainer = _trainer(fp16.CFG, FP16, check=True)
    trainer.inner.scaler = LossScaler(ScalerConfig(init_scale=2.0 ** 8, growth_interval=1000))
    data, real, results = list(fp16._batches(3, BATCH)), run.head_loss, []
    unchanged = None
    for step, (x, y) in enumerate(data):
        before = {k: v.clone() for k, v in trainer.opt.shard_state().entries.items()}
        if step == 1 and dist.get_rank() == bad_rank:
            run.head_loss = lambda *a, **k: real(*a, **k) * 1e6
        results.append(trainer.step(x, y))
        run.head_loss = real
        if step == 1:
            after = trainer.opt.shard_state().entries
            unchanged = all(torch.equal(before[k], after[k]) for k in before if k not in ("steps", "skipped_steps"))
    counts = (trainer.opt.steps, trainer.opt.skipped_steps)
    trainer.close()
    return {"skipped": [r.skipped for r in results], "overflow": [r.overflow for r in results],
            "scales": [r.loss_scale for r in results], "counts": counts, "unchanged": unchanged}


def one_inf(bad_rank) -> dict:
    """Clipping (fp32): an inf in one element of the bottom block's gradient on ``bad_rank`` only, which the
    reduction puts into the first rank's shard alone: every rank's norm is inf and every rank skips."""
    trainer = _trainer(CFG, CPU32, 1.0, check=True)
    data, final = list(_batches(3, BATCH)), trainer.inner._final_block

    def poisoned(i, slot):
        if i == 0:
            trainer.inner.block_grads[0].view(-1)[0] = float("inf")
        final(i, slot)
    results = []
    for step, (x, y) in enumerate(data):
        before = {k: v.clone() for k, v in trainer.opt.shard_state().entries.items()}
        if step == 1 and dist.get_rank() == bad_rank:
            trainer.inner._final_block = poisoned
        results.append(trainer.step(x, y))
        trainer.inner._final_block = final
        if step == 1:
            after = trainer.opt.shard_state().entries
            unchanged = all(torch.equal(before[k], after[k]) for k in before if k not in ("steps", "skipped_steps"))
    counts = (trainer.opt.steps, trainer.opt.skipped_steps)
    trainer.close()
    return {"skipped": [r.skipped for r in results], "norm": results[1].grad_norm, "counts": counts,
            "unchanged": unchanged}


def sharded_resume(out_dir) -> dict:
    """fp16 with clipping saved sharded after 4 steps (the scale grown once by then) resumes, with a fresh
    scaler's settings, into the uninterrupted run's next step bit for bit."""
    from nanotrain.data import DataPosition
    from nanotrain.checkpoint.resume import restore
    from nanotrain.checkpoint.state import save_checkpoint
    sc, data = ScalerConfig(init_scale=2.0 ** 8, growth_interval=3), list(fp16._batches(5, BATCH))
    whole = _trainer(fp16.CFG, FP16, 0.5)
    whole.inner.scaler = LossScaler(sc)
    for x, y in data[:4]:
        whole.step(x, y)
    ckpt = save_checkpoint(out_dir, whole, DataPosition(0, 0))
    want = whole.step(*data[4])
    whole.close()
    resumed = _trainer(fp16.CFG, FP16, 0.5)
    restore(resumed, ckpt)
    got = resumed.step(*data[4])
    resumed.close()
    return {"want": (want.loss, want.loss_scale, want.grad_norm), "got": (got.loss, got.loss_scale, got.grad_norm)}


def worker(out_dir) -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "gloo", timeout_s=60)
    out = {}
    with ctx.guard():
        for max_norm in (NEVER, ALWAYS):
            ctx.where = f"clip {max_norm}"
            out[max_norm] = clipped_run(max_norm)
        for clip, tail in FP16_RUNS:
            ctx.where = f"fp16 clip {clip}"
            out["fp16", clip] = fp16_run(clip, tail)
        ctx.where = "overflow"
        out["overflow"] = injected_overflow(ctx.world_size - 1)
        ctx.where = "one inf"
        out["inf"] = one_inf(ctx.world_size - 1)
        ctx.where = "sharded resume"
        out["resume"] = sharded_resume(out_dir)
    close_distributed(ctx)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def world(request, tmp_path_factory) -> list[dict]:
    return spawn(worker, request.param, (tmp_path_factory.mktemp("ckpt"),), start_method="fork", timeout_s=120)


@pytest.mark.parametrize("max_norm", [NEVER, ALWAYS])
def test_clipping_equals_autograd_clip_grad_norm_and_adamw(world, max_norm):
    torch.set_num_threads(1)
    ref, ref_losses, ref_norms = _reference(STEPS, max_norm=max_norm, batch=BATCH, grads=(ref_grads := []))
    runs = [per_rank[max_norm] for per_rank in world]
    shapes = {path: g.shape for path, g in ref_grads[0].items()}
    grads = [{p: g.view(shapes[p]) for p, g in applied(runs, s).items()} for s in range(STEPS)]  # from the pieces
    grad_rtol, sizes = chain_rtol(model_chain(CFG, 16, BATCH * 16)), [g.numel() for g in ref_grads[0].values()]
    for rank, r in enumerate(runs):  # the clipped gradients each side's AdamW applied: the data-parallel test's bounds
        assert r["clipped"] == [max_norm == ALWAYS] * STEPS and not any(r["skipped"]), rank
        apart = unclipped_apart(grads, ref_grads, r["norms"], ref_norms, max_norm)
        assert_norms(r["norms"], ref_norms, apart, grad_rtol, sizes, len(world))
        assert_adam_run(runs[0]["masters"], ref, (r["losses"], grads), (ref_losses, ref_grads), batch=BATCH)
    assert all(w[max_norm]["masters"] is None for w in world[1:])  # gathered on the first rank only


@pytest.mark.parametrize("clip,tail", FP16_RUNS)
def test_fp16_equals_gradscaler_and_adamw(world, clip, tail):
    torch.set_num_threads(1)
    ref, _, ref_scales = fp16._reference(FP16_STEPS, SCALER, clip=clip, batch=BATCH)
    for rank, per_rank in enumerate(world):
        r = per_rank["fp16", clip]
        assert r["scales"] == ref_scales, rank
        assert any(r["skipped"]) and not all(r["skipped"]) and r["overflow"] == r["skipped"], rank
        assert r["counts"] == (FP16_STEPS - sum(r["skipped"]), sum(r["skipped"])), rank
    assert_own_losses([per_rank["fp16", clip] for per_rank in world], "streamed")
    applied = sum(not s for s in world[0]["fp16", clip]["skipped"])
    fp16.assert_masters_moved(world[0]["fp16", clip]["masters"], ref, applied)  # tests/core/test_fp16.py says why


def test_an_overflow_on_one_rank_skips_that_step_on_every_rank(world):
    for rank, per_rank in enumerate(world):
        assert per_rank["overflow"] == {"skipped": [False, True, False], "overflow": [False, True, False],
                                        "scales": [2.0 ** 8, 2.0 ** 8, 2.0 ** 7], "counts": (2, 1),
                                        "unchanged": True}, (rank, per_rank["overflow"])
        assert per_rank["inf"] == {"skipped": [False, True, False], "norm": float("inf"), "counts": (2, 1),
                                   "unchanged": True}, (rank, per_rank["inf"])


def test_host_plan_counts_the_kept_gradient_shards():
    """A deferred step keeps the layer-major blocks' fp32 gradients in one process, and every unit's
    reduced shard (4/N bytes a parameter) on each of N ranks."""
    from nanotrain.stream.footprint import StreamChoice, StreamJob, estimate

    xl = preset("gpt2-xl")
    costs = model_spec(xl).costs
    for n, kept in ((1, costs.n_layer * costs.block_params * 4), (2, costs.total_params * 2),
                    (3, costs.total_params * 4 // 3)):
        plain, deferred = (estimate(StreamJob(xl, 32, 1024, 8, shards=n, deferred=d), StreamChoice(4))
                           for d in (False, True))
        assert dict(deferred.host)["kept gradients"] == kept and dict(plain.host)["kept gradients"] == 0, n
        assert sum(b for _, b in deferred.host) - sum(b for _, b in plain.host) == kept, n


def test_a_sharded_checkpoint_resumes_the_scale_and_the_step_exactly(world):
    for per_rank in world:
        r = per_rank["resume"]
        assert r["want"][1] == 2.0 ** 9 and r["got"] == r["want"], r  # the default scale would not give 2**9
