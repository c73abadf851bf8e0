"""Gradient clipping and fp16 loss scaling in the 3D trainer (``nanotrain.compose``) against one process, at 2, 3
and 4 CPU ranks (gloo).

Clipping (fp32), tensor-parallel (tp 2, tp 3: uneven heads) and pipeline-parallel (pp 2 with the tied embedding on
both ends, pp 3), and with two replicas (tp 2 x dp 2 under ZeRO-1, pp 2 x dp 2 under DDP): against plain autograd
on the whole batch + ``torch.nn.utils.clip_grad_norm_`` + AdamW, clipping every step. Bounds as
``test_parallel3d_dp`` derives them from the clipped gradients each rank's AdamW applied: each weight after the
last step within what AdamW makes of them, each loss within the chain's bound plus what that moves it
(``conftest.adam_bounds``), each norm within the distance of those gradients unclipped (``conftest.assert_norms``).

fp16 (pp 2, pp 3, with and without clipping): against ``torch.amp.GradScaler`` + AdamW (``tests.core.test_fp16``'s
reference) over steps that overflow, back off and grow the scale: the scales and skips alike, each loss that of
the masters its step started from, the masters within the bounds the data-parallel fp16 test derives (``FP16_BULK``, ``FP16_RARE``): a stage
computes each micro-batch as one process does, but the tied embedding's two gradients, which one process adds in
fp16 within its backward, are summed here in fp32 (their copies' all-reduce): the same sum in another order.
"""
from __future__ import annotations

import pytest
import torch

from nanotrain.core.models import init_params, loss as lm_loss, model_spec, preset
from nanotrain.core.models.run import tree_from
from nanotrain.core.optim import OffloadConfig
from nanotrain.core.train.scaler import LossScaler, ScalerConfig
from nanotrain.core.tree import get_path, named_leaves, tree_map
from nanotrain.compose import Parallel3DTrainer, build_3d
from nanotrain.data_parallel import DPConfig
from nanotrain.distributed import GridConfig, build_grid, close_distributed, init_distributed, launched_world_size, spawn
from nanotrain.pipeline import build_schedule
from nanotrain.tensor_parallel.shard import TPPlan, shard_leaf
from tests.compose import test_parallel3d_dp as dp
from tests.compose.test_parallel3d import ADAM, BATCH, CFG, EPS, FP32, LR, MICRO, SEQ, STEPS, data
from tests.conftest import assert_norms, chain_rtol, model_chain, unclipped_apart
from tests.core import test_fp16 as fp16
from tests.core.test_fp16 import FP16_BULK, FP16_RARE

CLIP = 0.05  # below every step's norm here (asserted on the reference): every step clips
FP16_CFG = preset("tiny", n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_ctx=16)
FP16 = OffloadConfig(device="cpu", dtype=torch.float16, offload=False)
SCALER = ScalerConfig(init_scale=2.0 ** 20, growth_interval=3)  # overflows the first steps, then grows
FP16_STEPS = 10
DDP, ZERO1 = DPConfig(bucket_mb=0), DPConfig(zero=1, bucket_mb=0)
# world size: name -> (grid, schedule, data parallelism); 4 ranks: the replicas' norm (DDP: counted by the first
# replica; ZeRO: each its shard)
CLIP_LAYOUTS = {2: {"tp2": (GridConfig(tp=2), "gpipe", DDP), "pp2": (GridConfig(pp=2), "1f1b", DDP)},
                3: {"tp3": (GridConfig(tp=3), "gpipe", DDP), "pp3": (GridConfig(pp=3), "1f1b", DDP)},
                4: {"tp2 dp2 zero1": (GridConfig(tp=2, dp=2), "gpipe", ZERO1),
                    "pp2 dp2": (GridConfig(pp=2, dp=2), "1f1b", DDP)}}
FP16_LAYOUTS = {2: {"pp2": GridConfig(pp=2)}, 3: {"pp3": GridConfig(pp=3)}, 4: {}}


def clipped_run(ctx, grid: GridConfig, schedule: str, dcfg: DPConfig) -> dict:
    ctx.grid = build_grid(grid, timeout=ctx.grid.timeout)
    p3d = build_3d(ctx, CFG, build_schedule(schedule, grid.pp, MICRO), SEQ, BATCH // (grid.dp * MICRO))
    trainer = Parallel3DTrainer(p3d, ADAM, FP32, dcfg, clip_norm=CLIP)
    tokens, targets = data()
    results, grads = [], []  # every step's reduced gradients, clipped in place: what this rank's Adam applied
    for s in range(STEPS):
        results.append(trainer.step(tokens[s], targets[s]))
        grads.append([(b, trainer.opt.reduced(b).clone()) for b in trainer.opt.buckets])
    weights = {path: t.detach().clone() for path, t in trainer.named_parameters()}
    plan = p3d.plan
    trainer.close()
    ranges = (plan.q_heads, plan.kv_heads, plan.neurons, plan.vocab, plan.padded_vocab)
    return {"norms": [r.grad_norm for r in results], "clipped": [r.clipped for r in results],  # as dp.worker's:
            "run": ([r.loss for r in results], grads, weights, ranges, ctx.grid.dp_rank, ctx.grid.pp_rank, None)}


def fp16_run(ctx, grid: GridConfig, clip: float | None) -> dict:
    ctx.grid = build_grid(grid, timeout=ctx.grid.timeout)
    p3d = build_3d(ctx, FP16_CFG, build_schedule("1f1b", grid.pp, 2), 16, 2, dtype=torch.float16,
                   weights=init_params(FP16_CFG, seed=1))
    trainer = Parallel3DTrainer(p3d, fp16.ADAM, FP16, DPConfig(bucket_mb=0), clip_norm=clip)
    trainer.scaler = LossScaler(SCALER)
    def masters() -> dict[str, torch.Tensor]:  # this rank's stage's
        return {k.removeprefix("master."): v.clone() for k, v in trainer.opt.state_dict().items()
                if k.startswith("master.")}

    results, before = [], []  # before: the masters each step started from
    for x, y in fp16._batches(FP16_STEPS, batch=4):
        before.append(masters())
        results.append(trainer.step(x, y))
    out = {"losses": [r.loss for r in results], "scales": [r.loss_scale for r in results],
           "skipped": [r.skipped for r in results], "overflow": [r.overflow for r in results], "masters": masters(),
           "before": before}
    trainer.close()
    return out


def worker() -> dict:
    torch.set_num_threads(1)
    world = launched_world_size()
    ctx = init_distributed(GridConfig(dp=world), "gloo", timeout_s=120)
    out = {}
    with ctx.guard():
        for name, (grid, schedule, dcfg) in CLIP_LAYOUTS[world].items():
            ctx.where = f"clip {name}"
            out["clip", name] = clipped_run(ctx, grid, schedule, dcfg)
        for name, grid in FP16_LAYOUTS[world].items():
            for clip in (None, 0.5):
                ctx.where = f"fp16 {name} clip {clip}"
                out["fp16", name, clip] = fp16_run(ctx, grid, clip)
    close_distributed(ctx)
    return out


@pytest.fixture(scope="module", params=[2, 3, 4])
def world(request) -> tuple[int, list[dict]]:
    return request.param, spawn(worker, request.param, timeout_s=170, start_method="fork")


def clipped_reference() -> tuple[list[float], list[float], list[dict], dict[str, torch.Tensor]]:
    """One process, the whole batch, ``clip_grad_norm_`` before each AdamW step: losses, norms, each step's clipped
    gradients, the last weights."""
    params = tree_map(lambda t: t.requires_grad_(), init_params(CFG, seed=0))
    leaves = [t for _, t in named_leaves(params)]
    opt = torch.optim.AdamW(leaves, lr=LR, eps=EPS)
    tokens, targets = data()
    losses, norms, grads = [], [], []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(params, tokens[s], targets[s], CFG)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(leaves, CLIP).item())
        grads.append({path: t.grad.clone() for path, t in named_leaves(params)})
        opt.step()
        losses.append(loss.item())
    return losses, norms, grads, {path: t.detach().clone() for path, t in named_leaves(params)}


def bucket_apart(runs: list[tuple], ref_grads: list[dict], norms: list[float], ref_norms: list[float]) -> list[float]:
    """``conftest.unclipped_apart`` of the 3D run's buckets put together (``dp.applied``) against the same slices of
    the reference's: each (stage, TP shard, bucket) once, a replicated leaf once per TP rank."""
    whole, cut = dp.applied(runs), {}
    for _, grads, _, ranges, _, pp_rank, _ in runs:
        plan = TPPlan(model_spec(CFG), None, False, *ranges)
        cut.update({(pp_rank, repr(ranges), b.name): (b, plan) for b, _ in grads[0]})
    out = []
    for s, (n, rn) in enumerate(zip(norms, ref_norms, strict=True)):
        mine, ref = {}, {}
        for key, (b, plan) in cut.items():
            mine[key] = whole[key][s]
            ref[key] = b.flatten({path: shard_leaf(path, ref_grads[s][path], plan) for path in b.paths})
        out += unclipped_apart([mine], [ref], [n], [rn], CLIP)
    return out


def test_clipping_equals_autograd_clip_grad_norm_and_adamw(world):
    size, per_rank = world
    ref_losses, ref_norms, ref_grads, ref_weights = clipped_reference()
    assert min(ref_norms) > CLIP  # every step clips
    assert dp.CFG == CFG and dp.STEPS == STEPS  # dp's helpers start from its model
    loss_rtol = chain_rtol(model_chain(CFG, SEQ, BATCH * SEQ, "loss"))
    grad_rtol = chain_rtol(model_chain(CFG, SEQ, BATCH * SEQ))
    sizes = [t.numel() for t in ref_weights.values()]
    for name in CLIP_LAYOUTS[size]:
        seen, runs = set(), [result["clip", name]["run"] for result in per_rank]
        aparts, moved = dp.apart_bounds(runs, False, ref_grads, dp.applied(runs), ADAM)
        for rank, result in enumerate(per_rank):
            r = result["clip", name]
            losses, _, weights, ranges, _, _, _ = r["run"]
            assert r["clipped"] == [True] * STEPS, (name, rank)
            for s, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
                assert abs(a - b) <= loss_rtol * abs(b) + moved[s], f"{name}, rank {rank}, step {s}: {a} != {b}"
            assert_norms(r["norms"], ref_norms, bucket_apart(runs, ref_grads, r["norms"], ref_norms), grad_rtol,
                         sizes, size)
            plan = TPPlan(model_spec(CFG), None, False, *ranges)  # the rank's slices
            for path, w in weights.items():  # each element within what AdamW makes of the gradients each side applied
                over = ((w - shard_leaf(path, ref_weights[path], plan)).abs() / aparts[rank][path][-1].view_as(w)).max()
                assert over <= 1, f"{name}, rank {rank}: weight {path} after {STEPS} steps {over:.2f} times its bound"
            seen |= set(weights)
        assert seen == set(ref_weights), name


@pytest.mark.parametrize("clip", [None, 0.5])
def test_fp16_equals_gradscaler_and_adamw(world, clip):
    size, per_rank = world
    if not FP16_LAYOUTS[size]:
        pytest.skip(f"no fp16 layout at {size} ranks (the replicas' norm is the clipping test's)")
    ref, _, ref_scales = fp16._reference(FP16_STEPS, SCALER, clip=clip, cfg=FP16_CFG)
    c = FP16_CFG.n_embd
    for name in FP16_LAYOUTS[size]:
        seen = set()
        for rank, result in enumerate(per_rank):
            r = result["fp16", name, clip]
            assert r["scales"] == ref_scales, (name, rank)
            assert any(r["skipped"]) and not all(r["skipped"]) and r["overflow"] == r["skipped"], (name, rank)
            for s, (x, y) in enumerate(fp16._batches(FP16_STEPS, batch=4)):
                # that of the masters the step started from, every stage's (test_fp16._steps_at_own_weights): the
                # same fp16 copies give each micro-batch's loss bit for bit, then the sum of the 2
                start = tree_from(model_spec(FP16_CFG), [kv for res in per_rank for kv in res["fp16", name, clip][
                    "before"][s].items()])
                want = fp16.loss_at(start, x, y, FP16_CFG)
                assert abs(r["losses"][s] - want) <= chain_rtol([2], runs=1) * want, (name, rank, s, r["losses"], want)
            applied = FP16_STEPS - sum(r["skipped"])
            for path, a in r["masters"].items():
                b = get_path(ref, path).detach()
                if path.endswith("qkv_b"):  # the key bias: rounding noise moved by Adam (test_fp16 says why)
                    assert (a[c:2 * c] - b[c:2 * c]).abs().max() <= applied * fp16.ADAM.lr, (name, path)
                    a, b = torch.cat([a[:c], a[2 * c:]]), torch.cat([b[:c], b[2 * c:]])
                moved = (a - b).abs() / fp16.ADAM.lr  # the data-parallel test's bounds, and why
                assert moved.max() <= 2 * applied, (name, rank, path, moved.max())
                assert (moved > applied * FP16_BULK).float().mean() <= FP16_RARE, (name, rank, path)
            seen |= set(r["masters"])
        assert seen == {path for path, _ in named_leaves(ref)}, name
