"""Gradient clipping and fp16 loss scaling under data parallelism (DDP, ZeRO-1/2/3, ZeRO-3 holding its weights) at 2
and 3 CPU ranks.

Clipping (fp32): each stage against plain autograd on the whole batch + ``torch.nn.utils.clip_grad_norm_``
+ ``torch.optim.AdamW`` (``tests.core.test_trainer._reference``), with clipping triggered on every step and on
none: the clip flags; from the clipped gradients each side's AdamW applied, the masters after 3 steps and every
step's loss (``test_trainer.assert_adam_run``) and norm (``conftest.assert_norms``).

fp16: each stage against ``torch.amp.GradScaler`` + AdamW (``tests.core.test_fp16._reference``) over steps
that overflow, back off and grow the scale: the scales, skips, losses and weights. Then an overflow
injected into one rank's data only: every rank skips that one step, halves its scale, and applies
the next (the optimizer's own step counts say so, not only the reported flags). The scaler's state
goes into sharded checkpoints and comes back, at the saved layout and resharded into another.

One forked world per size runs every check, to stay fast on two cores.
"""
from __future__ import annotations

import pytest
import torch

from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.core.models import init_params, run
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from nanotrain.core.optim import OffloadConfig
from nanotrain.core.train.resident import TrainConfig
from nanotrain.core.train.scaler import LossScaler, ScalerConfig
from nanotrain.core.train.step import masters_tree
from nanotrain.core.tree import get_path, named_leaves
from tests.core import test_fp16 as fp16
from tests.conftest import assert_norms, chain_rtol, model_chain, unclipped_apart
from tests.core.test_trainer import ADAM, CFG, CPU32, _batches, _reference, assert_adam_run
from tests.data_parallel.dp_cases import SAME_LOSS_RTOL, reduced_grads, spied

BATCH, STEPS, FP16_STEPS = 12, 3, 8
NEVER, ALWAYS = 1e9, 0.05  # this model's gradient norms are ~1-3
STAGES = {"ddp": DPConfig(zero=0, bucket_mb=0.3), "zero1": DPConfig(zero=1, bucket_mb=0.3),
          "zero2": DPConfig(zero=2, bucket_mb=0), "zero3": DPConfig(zero=3), "zero3-held": DPConfig(zero=3, hold=True)}
SCALER = ScalerConfig(init_scale=2.0 ** 20, growth_interval=3)  # overflows the first steps, then grows
FP16_CLIP = 0.5
FP16_BULK, FP16_RARE = fp16.FP16_BULK, fp16.FP16_RARE  # derived below, in test_fp16_equals_gradscaler_and_adamw


def _trainer(cfg, ocfg, dcfg, clip_norm=None, micro=2):
    import torch.distributed as dist
    tcfg = TrainConfig(batch=BATCH, micro_batch=micro, recompute="every", clip_norm=clip_norm)
    return data_parallel_trainer(cfg, init_params(cfg, seed=1), tcfg, fp16.ADAM if cfg is fp16.CFG else ADAM,
                                 ocfg, dcfg, dist.group.WORLD)


def _masters(trainer):
    state = trainer.state_dict()  # collective; the whole state on the first rank only
    return masters_tree(trainer.cfg, {k: t.clone() for k, t in state.items()}) if state else None


def clipped_run(dcfg, max_norm) -> dict:
    grads = []  # each step's reduced gradients, clipped, as this rank's AdamW applied them
    trainer = spied(_trainer(CFG, CPU32, dcfg, max_norm), grads)
    results = [(grads.append([]), trainer.step(x, y))[1] for x, y in _batches(STEPS, BATCH)]
    out = {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results], "grads": grads,
           "clipped": [r.clipped for r in results], "masters": _masters(trainer),
           "buckets": trainer.inner.weights.buckets if dcfg.zero == 3 else trainer.opt.buckets}
    trainer.close()
    return out


def fp16_run(dcfg, clip) -> dict:
    ocfg = OffloadConfig(device="cpu", dtype=torch.float16, exact_skip=True)
    trainer = _trainer(fp16.CFG, ocfg, dcfg, clip)
    trainer.inner.scaler = LossScaler(SCALER)
    results, before = steps_from(trainer, _masters)
    out = {"losses": [r.loss for r in results], "scales": [r.loss_scale for r in results],
           "skipped": [r.skipped for r in results], "overflow": [r.overflow for r in results],
           "masters": _masters(trainer), "before": before}
    trainer.close()
    return out


def steps_from(trainer, masters) -> tuple[list, list]:
    """``FP16_STEPS`` of ``fp16._batches``: each step's result, and the masters it started from (``masters(trainer)``,
    collective: the whole on the first rank)."""
    results, before = [], []
    for x, y in fp16._batches(FP16_STEPS, BATCH):
        before.append(masters(trainer))
        results.append(trainer.step(x, y))
    return results, before


def assert_own_losses(runs: list[dict], what) -> None:
    """Every rank's losses (``runs``: each rank's) those of the masters each step started from (the first rank's
    ``before``), as ``test_fp16._steps_at_own_weights`` checks one process: their fp16 copies give each micro-batch's
    loss bit for bit, and the ranks sum them as test_data_parallel says (``SAME_LOSS_RTOL``). That the masters
    follow the reference's is the weights' bound's."""
    for s, ((x, y), masters) in enumerate(zip(fp16._batches(FP16_STEPS, BATCH), runs[0]["before"], strict=True)):
        want = fp16.loss_at(masters, x, y)
        for rank, r in enumerate(runs):
            assert abs(r["losses"][s] - want) <= SAME_LOSS_RTOL * want, (what, rank, s, r["losses"][s], want)


def injected_overflow(dcfg, bad_rank) -> dict:
    """Step 2's loss on ``bad_rank`` only is multiplied by 1e6: its scaled fp16 gradients overflow."""
    import torch.distributed as dist
    ocfg = OffloadConfig(device="cpu", dtype=torch.float16, exact_skip=True)
    trainer = _trainer(fp16.CFG, ocfg, dcfg)
    trainer.inner.scaler = LossScaler(ScalerConfig(init_scale=2.0 ** 8, growth_interval=1000))
    data, real, results = list(fp16._batches(3, BATCH)), run.head_loss, []
    for step, (x, y) in enumerate(data):
        if step == 1 and dist.get_rank() == bad_rank:
            run.head_loss = lambda *a, **k: real(*a, **k) * 1e6
        results.append(trainer.step(x, y))
        run.head_loss = real
    trainer.opt.synchronize()
    counts = (trainer.opt.steps, trainer.opt.skipped_steps)
    trainer.close()
    return {"skipped": [r.skipped for r in results], "overflow": [r.overflow for r in results],
            "scales": [r.loss_scale for r in results], "counts": counts}


def sharded_scaler(out_dir) -> dict:
    """fp16 ZeRO-2 saved sharded after 4 steps, resumed as ZeRO-2 (own files) and ZeRO-1 (resharded)."""
    from nanotrain.data import DataPosition
    from nanotrain.checkpoint.resume import restore
    from nanotrain.checkpoint.state import save_checkpoint
    ocfg = OffloadConfig(device="cpu", dtype=torch.float16, exact_skip=True)
    sc = ScalerConfig(init_scale=2.0 ** 8, growth_interval=3)
    data = list(fp16._batches(5, BATCH))
    whole = _trainer(fp16.CFG, ocfg, STAGES["zero2"])
    whole.inner.scaler = LossScaler(sc)
    for x, y in data[:4]:
        whole.step(x, y)
    ckpt = save_checkpoint(out_dir, whole, DataPosition(0, 0))
    want = whole.step(*data[4])
    whole.close()
    out = {"want": (want.loss, want.loss_scale)}
    for name in ("zero2", "zero1"):
        resumed = _trainer(fp16.CFG, ocfg, STAGES[name])
        resumed.inner.scaler = LossScaler(ScalerConfig())
        restore(resumed, ckpt)
        got = resumed.step(*data[4])
        out[name] = (got.loss, got.loss_scale)
        resumed.close()
    return out


def worker(out_dir) -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "gloo", timeout_s=60)
    out = {}
    with ctx.guard():
        for name, dcfg in STAGES.items():
            for max_norm in (NEVER, ALWAYS):
                ctx.where = f"clip {name} {max_norm}"
                out[name, max_norm] = clipped_run(dcfg, max_norm)
            for clip in (None, FP16_CLIP):
                ctx.where = f"fp16 {name} clip {clip}"
                out[name, "fp16", clip] = fp16_run(dcfg, clip)
            ctx.where = f"overflow {name}"
            out[name, "overflow"] = injected_overflow(dcfg, ctx.world_size - 1)
        ctx.where = "sharded scaler"
        out["sharded"] = sharded_scaler(out_dir)
    close_distributed(ctx)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def world(request, tmp_path_factory) -> list[dict]:
    return spawn(worker, request.param, (tmp_path_factory.mktemp("ckpt"),), start_method="fork", timeout_s=120)


@pytest.mark.parametrize("max_norm", [NEVER, ALWAYS])
def test_clipping_equals_autograd_clip_grad_norm_and_adamw(world, max_norm):
    torch.set_num_threads(1)
    ref, ref_losses, ref_norms = _reference(STEPS, max_norm=max_norm, batch=BATCH, grads=(ref_grads := []))
    grad_rtol, sizes = chain_rtol(model_chain(CFG, 16, BATCH * 16)), [g.numel() for g in ref_grads[0].values()]
    for name in STAGES:
        runs = [per_rank[name, max_norm] for per_rank in world]
        grads = [reduced_grads(runs, STAGES[name].zero, s) for s in range(STEPS)]
        for rank, r in enumerate(runs):
            assert r["clipped"] == [max_norm == ALWAYS] * STEPS, (name, rank)
            apart = unclipped_apart(grads, ref_grads, r["norms"], ref_norms, max_norm)
            assert_norms(r["norms"], ref_norms, apart, grad_rtol, sizes, len(world))
            assert_adam_run(runs[0]["masters"], ref, (r["losses"], grads), (ref_losses, ref_grads), batch=BATCH)
        assert all(w[name, max_norm]["masters"] is None for w in world[1:]) == (STAGES[name].zero > 0), name


@pytest.mark.parametrize("clip", [None, FP16_CLIP])
def test_fp16_equals_gradscaler_and_adamw(world, clip):
    """Scales and skips exactly, each loss that of its own masters; the masters against what the steps can move.

    Both sides compute each micro-batch in fp16 and sum in fp32, in other orders (ranks, buckets, ZeRO-3's gathers,
    a CPU's fp16 kernels). An element's fp16 gradient carries the roundings on its path, about eight of 2^-11
    forward and backward; Adam, which moves an element by about lr a step whatever the gradient's scale, turns that
    relative error into at most ``FP16_BULK`` = 8 2^-11 lr per applied step: the bulk. Where a gradient is near zero
    at some step, the same rounding can flip its sign, a move of up to 2 lr: legal, but rare. Measured with the
    reference itself summed in other orders (micro-batches of 1 to 12 rows): at most 3 of a leaf's 32 elements
    beyond the bulk (9%); the ranks' runs, one element of 3072 at most (1.8% of lr on a Xeon whose fp16 matmuls are
    oneDNN's AVX512-FP16 kernels). So at most ``FP16_RARE`` of a leaf, and none beyond 2 lr per applied step. A lost
    update moves nearly every element by about lr, and an unclipped step over 70% of some leaf beyond the bulk: both
    fail. (A clip factor off by a constant hardly shows in Adam's steps, which are blind to the gradient's scale: the
    norms it is computed from are checked in fp32 above.) The key bias is apart: its true gradient is 0 and Adam
    moves its rounding noise by up to lr per applied step (tests/core/test_trainer.py).
    """
    torch.set_num_threads(1)
    ref, _, ref_scales = fp16._reference(FP16_STEPS, SCALER, clip=clip, batch=BATCH)
    c = fp16.CFG.n_embd
    for name in STAGES:
        for rank, per_rank in enumerate(world):
            r = per_rank[name, "fp16", clip]
            assert r["scales"] == ref_scales, (name, rank)
            assert any(r["skipped"]) and not all(r["skipped"]) and r["overflow"] == r["skipped"], (name, rank)
        assert_own_losses([per_rank[name, "fp16", clip] for per_rank in world], name)
        ours = world[0][name, "fp16", clip]["masters"]
        applied = sum(not s for s in world[0][name, "fp16", clip]["skipped"])
        for path, t in named_leaves(ref):
            a, b = get_path(ours, path), t.detach()
            if path.endswith("qkv_b"):
                assert (a[c:2 * c] - b[c:2 * c]).abs().max() <= applied * fp16.ADAM.lr, (name, path)
                a, b = torch.cat([a[:c], a[2 * c:]]), torch.cat([b[:c], b[2 * c:]])
            moved = (a - b).abs() / fp16.ADAM.lr
            assert moved.max() <= 2 * applied, (name, path, moved.max())
            assert (moved > applied * FP16_BULK).float().mean() <= FP16_RARE, (name, path, moved.quantile(0.75))


def test_an_overflow_on_one_rank_skips_that_step_on_every_rank(world):
    for name in STAGES:
        for rank, per_rank in enumerate(world):
            assert per_rank[name, "overflow"] == {"skipped": [False, True, False], "overflow": [False, True, False],
                                                  "scales": [2.0 ** 8, 2.0 ** 8, 2.0 ** 7], "counts": (2, 1)}, \
                (name, rank, per_rank[name, "overflow"])


def test_sharded_checkpoints_keep_the_loss_scale(world):
    for per_rank in world:
        r = per_rank["sharded"]
        assert r["want"][1] == 2.0 ** 9  # grown after 3 good steps: the default scale would not give it
        assert r["zero2"] == r["want"] and r["zero1"][1] == r["want"][1], r
        assert abs(r["zero1"][0] - r["want"][0]) <= SAME_LOSS_RTOL * r["want"][0], r  # the same state: the sums
