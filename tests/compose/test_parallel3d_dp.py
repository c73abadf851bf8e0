"""3D parallelism through the data-parallel engine (``Parallel3DTrainer``: ``DataParallelAdam`` over each rank's
leaves, DDP or ZeRO-1/2, 32- or 8-bit moments), the DP reductions started stage by stage as each is done.

Three worlds, 4 (1x2x2, 2x1x2), 8 (2x2x2) and 6 (1x2x3, 2x1x3; tp x pp x dp: 3 replicas pad every bucket
to a multiple of 3), each running several layouts in turn for three steps on the same global batch as one
process: every loss, the first step's reduced gradient of every bucket (under ZeRO each rank's shard of
it) and the weights after the last step, against one process running nanotrain's AdamW
(``optim.OffloadAdam``) with the same moment bits. Buckets are one unit each, or 25 MB (every unit of a
rank in one bucket, the tied embedding's included, which is final last).

The bounds (fp32), from the computation, so they hold whatever order a CPU's kernels or threads sum in:
losses and gradients within ``conftest.chain_rtol`` of the reductions they come out of (2.9e-5 and
5.9e-5 here; measured <= 1e-6), each weight within what AdamW makes of the gradients each side applied
at every step, and each later loss within what that distance moves it (``conftest.adam_bounds``: a
gradient rounded in an element where |g| is near eps moves the update by up to 2 lr, which a norm-wise
1e-5 did not allow: on a Xeon with AVX-512, zero-initialised ``blocks.3.fc_b`` ended 1.02e-5 apart).
8-bit moments are compared against the single-process 8-bit AdamW (the first loss within the fp32 bound, the
later ones plus what the weights before them, measured apart, move them: ``conftest.moved_by``; the weights
after three steps are what differs):

- tp 1: every leaf is quantized in the blocks one process uses, DDP or ZeRO (each piece of a shard starts
  on a block: ``data_parallel.shards``), but a moment that sits on a rounding boundary may round to the
  neighbouring code: ``conftest.assert_codes_moved`` (measured: 0.05% of a leaf, 0.05 lr).
- tp 2: a TP shard is quantized as a leaf of its own, in other blocks than the whole leaf's (other
  absmax per block): two valid 8-bit runs, measured 3.1e-3 apart; 1e-2 is the claim, not a bound (how far
  two block layouts' codes take Adam apart depends on where each moment falls in its block's code: each
  run's moments within half a code cell, up to 7% of a moment, its update up to ~9% of lr, 0.54 lr between
  the two over 3 steps, 2.7e-2 of a matrix of std 0.02 were every rounding aligned; 1e-2 claims they cancel).

bf16 compute with fp32 masters (ZeRO-1, 1x2x2) is compared with the fp32 process as a whole per
rank: bf16 rounding is noise that AdamW turns into whole steps on small, zero-initialised biases.
"""
from __future__ import annotations

import math

import torch

from nanotrain.data_parallel import DPConfig
from nanotrain.distributed import GridConfig, build_grid, close_distributed, init_distributed, spawn
from nanotrain.core.models import init_params, loss as lm_loss, model_spec, preset
from nanotrain.core.optim import AdamConfig, OffloadAdam, OffloadConfig
from nanotrain.compose import Parallel3DTrainer, build_3d
from nanotrain.pipeline import build_schedule
from nanotrain.pipeline.executor import last_backwards
from nanotrain.tensor_parallel.shard import TPPlan, shard_leaf
from nanotrain.core.tree import get_path, named_leaves, tree_map
from tests.conftest import adam_bounds, adam_cap, assert_codes_moved, chain_rtol, model_chain, moved_by, rel_err

CFG = preset("tiny", n_layer=4, n_embd=32, n_head=4, vocab_size=251, n_ctx=16)
SEQ, MICRO, STEPS = 16, 4, 3
ADAM = AdamConfig(lr=1e-3, eps=1e-6)
# bf16 compute with fp32 masters against the fp32 process, each rank's gradients and weights as a whole: the claim,
# not a bound (the chain's roundings at their worst, chain_rtol(..., torch.bfloat16), are 1.9: no check): each op of
# the chain rounds its output once to bf16 (u = 2^-9), independent errors adding in quadrature, u sqrt(ops): 1.8e-2
# for the gradients' 82 (measured 8e-3, the weights 2e-3); the losses, a mean over the tokens that averages them,
# within u (measured 1e-5)
BF16_U = 2.0 ** -9
BF16 = BF16_U * math.sqrt(len(model_chain(CFG, SEQ)))
BITS8 = {"block": 64, "min_8bit_numel": 256}  # blocks small enough that every matrix has several
ONE, BIG = 0.0, 25.0  # bucket megabytes: one unit per bucket, or a rank's every unit in one
# name: (grid, schedule, sequence parallel, zero, moment bits, bucket MB, tolerance)
LAYOUTS = {
    4: {
        "1x2x2 ddp 1f1b": (GridConfig(tp=1, pp=2, dp=2), "1f1b", False, 0, 32, BIG, None),
        "1x2x2 ddp interleaved": (GridConfig(tp=1, pp=2, dp=2), "interleaved-1f1b", False, 0, 32, ONE, None),
        "1x2x2 zero1 interleaved": (GridConfig(tp=1, pp=2, dp=2), "interleaved-1f1b", False, 1, 32, ONE, None),
        "1x2x2 zero2 1f1b": (GridConfig(tp=1, pp=2, dp=2), "1f1b", False, 2, 32, BIG, None),
        "2x1x2 zero2 1f1b sp": (GridConfig(tp=2, pp=1, dp=2), "1f1b", True, 2, 32, ONE, None),
        "1x2x2 ddp 1f1b adam8": (GridConfig(tp=1, pp=2, dp=2), "1f1b", False, 0, 8, ONE, None),
        "1x2x2 zero1 1f1b adam8": (GridConfig(tp=1, pp=2, dp=2), "1f1b", False, 1, 8, ONE, None),
        "1x2x2 zero1 1f1b bf16": (GridConfig(tp=1, pp=2, dp=2), "1f1b", False, 1, 32, ONE, BF16),
    },
    8: {
        "2x2x2 zero1 interleaved sp": (GridConfig(tp=2, pp=2, dp=2), "interleaved-1f1b", True, 1, 32, ONE, None),
        "2x2x2 ddp 1f1b sp adam8": (GridConfig(tp=2, pp=2, dp=2), "1f1b", True, 0, 8, ONE, 1e-2),
        "2x2x2 zero2 1f1b adam8": (GridConfig(tp=2, pp=2, dp=2), "1f1b", False, 2, 8, BIG, 1e-2),
    },
    6: {
        "1x2x3 zero1 interleaved": (GridConfig(tp=1, pp=2, dp=3), "interleaved-1f1b", False, 1, 32, ONE, None),
        "1x2x3 ddp 1f1b": (GridConfig(tp=1, pp=2, dp=3), "1f1b", False, 0, 32, ONE, None),
        "1x2x3 zero2 zb-h1": (GridConfig(tp=1, pp=2, dp=3), "zb-h1", False, 2, 32, ONE, None),
        "2x1x3 zero2 1f1b sp": (GridConfig(tp=2, pp=1, dp=3), "1f1b", True, 2, 32, BIG, None),
    },
}


def batch_of(world: int) -> int:
    return 12 if world == 6 else 16


def data(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (STEPS, batch, SEQ), generator=gen)
    targets = torch.randint(0, CFG.vocab_size, (STEPS, batch, SEQ), generator=gen)
    targets[:, :5, :7] = -100  # replicas see different counts of valid targets
    targets[:, -1, -1] = -100
    return tokens, targets


def ocfg(bits: int, dtype: torch.dtype = torch.float32) -> OffloadConfig:
    return OffloadConfig(device="cpu", dtype=dtype, offload=False, state_bits=bits, **(BITS8 if bits == 8 else {}))


def worker(world: int) -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=world), "gloo", timeout_s=120)
    batch = batch_of(world)
    tokens, targets = data(batch)
    out = {}
    with ctx.guard():
        for name, (grid, schedule, sp, zero, bits, bucket_mb, _) in LAYOUTS[world].items():
            ctx.grid = build_grid(grid, timeout=ctx.grid.timeout)
            dtype = torch.bfloat16 if "bf16" in name else torch.float32
            p3d = build_3d(ctx, CFG, build_schedule(schedule, grid.pp, MICRO), SEQ, batch // (grid.dp * MICRO),
                           sequence_parallel=sp, dtype=dtype)
            trainer = Parallel3DTrainer(p3d, ADAM, ocfg(bits, dtype),
                                        DPConfig(zero=zero, bucket_mb=bucket_mb))
            done = []
            stage_done = trainer.stage_done
            trainer.stage_done = lambda s: (done.append(s), stage_done(s))[-1]
            losses, grads, history = [], [], []  # every step's reduced gradients: what this rank's Adam applied
            for s in range(STEPS):
                losses.append(trainer.step(tokens[s], targets[s]).loss)
                grads.append([(b, trainer.opt.reduced(b).to(torch.float32, copy=True)) for b in trainer.opt.buckets])
                history.append({path: t.detach().to(torch.float32, copy=True)
                                for path, t in trainer.named_parameters()})
            weights = history.pop()
            plan = p3d.plan
            ranges = (plan.q_heads, plan.kv_heads, plan.neurons, plan.vocab, plan.padded_vocab)
            out[name] = (losses, grads, weights, ranges, ctx.grid.dp_rank, ctx.grid.pp_rank, done, history)
            trainer.close()
    close_distributed(ctx)
    return out


def reference(batch: int, bits: int) -> tuple[list[float], list[dict], dict, list[dict]]:
    """One process, the whole batch, nanotrain's AdamW with those moment bits: losses, every step's gradients,
    the weights after the last, and after each before it."""
    tokens, targets = data(batch)
    units = model_spec(CFG).unit_dict()
    ours = OffloadAdam(init_params(CFG, seed=0), units, ADAM, ocfg(bits))
    params = tree_map(lambda t: t.requires_grad_(), ours.params)
    losses, grads, history = [], [], []
    for s in range(STEPS):
        for _, t in named_leaves(params):
            t.grad = None
        loss = lm_loss(params, tokens[s], targets[s], CFG)
        loss.backward()
        grads.append({path: t.grad.clone() for path, t in named_leaves(params)})
        with torch.no_grad():
            for unit, paths in units.items():
                ours.update(unit, [get_path(params, p).grad for p in paths])
            for unit in units:
                ours.weights(unit)
        losses.append(loss.item())
        history.append({path: t.detach().clone() for path, t in named_leaves(params)})
    return losses, grads, history.pop(), history


def applied(runs: list[tuple]) -> dict:
    """Every step's whole reduced gradient of each bucket, by (pp rank, TP shard, bucket), put together from the
    dp ranks' shards under ZeRO: what the Adam of each element's owner applied. ``runs``: each rank's ``worker``
    result of one layout."""
    whole = {}
    for _, grads, _, ranges, dp_rank, pp_rank, *_ in runs:  # test_parallel3d_clip_fp16 records no history
        for s, step in enumerate(grads):
            for b, g in step:
                key = (pp_rank, repr(ranges), b.name)
                flats = whole.setdefault(key, [torch.zeros(b.padded) for _ in grads])
                flats[s][slice(*b.shard_range(dp_rank)) if g.numel() < b.padded else slice(None)] = g
    return whole


def apart_bounds(runs: list[tuple], sp: bool, ref_grads: list[dict], whole: dict,
                 hp: AdamConfig = ADAM) -> tuple[list, list]:
    """Per rank, ``conftest.adam_bounds`` of its leaves under AdamW ``hp``, and their moves of each step's loss summed
    over the ranks (replicas counted again: an upper bound)."""
    start, aparts, moved = dict(named_leaves(init_params(CFG, seed=0))), [], [0.0] * STEPS
    for _, grads, weights, ranges, _, pp_rank, *_ in runs:
        plan = TPPlan(model_spec(CFG), None, sp, *ranges)
        got = [{} for _ in range(STEPS)]  # every step's applied gradient by path, from the buckets put together
        for b, _ in grads[0]:
            for s, g in enumerate(whole[pp_rank, repr(ranges), b.name]):
                got[s].update(b.views(g))
        mine = [{path: shard_leaf(path, g[path], plan) for path in weights} for g in ref_grads]
        rank_aparts, rank_moved = adam_bounds({p: shard_leaf(p, start[p], plan) for p in weights}, got, mine, hp)
        aparts.append(rank_aparts)
        moved = [a + b for a, b in zip(moved, rank_moved)]
    return aparts, moved


def measured_moves(runs: list[tuple], sp: bool, ref_grads: list[dict], ref_history: list[dict]) -> list[float]:
    """What the ranks' weights before each step, measured apart from the reference's, move its loss
    (``conftest.moved_by`` at the reference's gradient there), summed over the ranks (replicas counted again)."""
    moved = [0.0] * STEPS
    for _, _, weights, ranges, _, _, _, history in runs:
        plan = TPPlan(model_spec(CFG), None, sp, *ranges)
        for s in range(1, STEPS):
            moved[s] += moved_by({p: shard_leaf(p, ref_grads[s][p], plan) for p in weights}, history[s - 1],
                                 {p: shard_leaf(p, ref_history[s - 1][p], plan) for p in weights})
    return moved


def check_world(world: int) -> None:
    per_rank = spawn(worker, world, (world,), timeout_s=170, start_method="fork")
    start = dict(named_leaves(init_params(CFG, seed=0)))
    refs = {bits: reference(batch_of(world), bits) for bits in {lay[4] for lay in LAYOUTS[world].values()}}
    tokens = batch_of(world) * SEQ
    loss_rtol = chain_rtol(model_chain(CFG, SEQ, tokens, "loss"))  # 2.9e-5: 4 blocks, head, the mean
    grad_rtol = chain_rtol(model_chain(CFG, SEQ, tokens))  # 5.9e-5: forward, backward, the sum over tokens
    for name, (grid, schedule, sp, zero, bits, _, tol) in LAYOUTS[world].items():
        ref_losses, ref_grads, ref_weights, ref_history = refs[bits]
        runs = [result[name] for result in per_rank]
        whole, seen = applied(runs), set()
        aparts, moved = apart_bounds(runs, sp, ref_grads, whole)
        if bits == 8:  # a moved code: the weights' fp32 bound does not hold; the later losses follow the weights
            moved = measured_moves(runs, sp, ref_grads, ref_history)  # measured apart
        for rank, result in enumerate(per_rank):
            losses, grads, weights, ranges, dp_rank, pp_rank, done, _ = result[name]
            plan, bf16, exact = TPPlan(model_spec(CFG), None, sp, *ranges), "bf16" in name, tol is None and bits == 32
            mine = [{path: shard_leaf(path, g[path], plan) for path in weights} for g in ref_grads]
            for s, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):  # each after s steps of AdamW
                bound = BF16_U * abs(b) if bf16 else loss_rtol * abs(b) + moved[s]
                assert abs(a - b) <= bound, f"{name}, rank {rank}, step {s}: {a} != {b}"
            got_g, want_g = [], []
            for b, g in grads[0]:  # this rank's part of the bucket's first reduced gradient (DDP: all of it)
                want = b.flatten(mine[0])[slice(*b.shard_range(dp_rank)) if zero else slice(None)]
                got_g.append(g)
                want_g.append(want)
                err = rel_err(g, want)
                assert bf16 or err <= grad_rtol, f"{name}, rank {rank}: gradient of {b.units} off by {err:.2e}"
            got_w = [w.reshape(-1) for w in weights.values()]
            want_w = [shard_leaf(path, ref_weights[path], plan).reshape(-1) for path in weights]
            if exact or (bits == 8 and grid.tp == 1):  # each element within what Adam makes of the gradients
                ref_w = {path: shard_leaf(path, ref_weights[path], plan) for path in weights}  # each side applied
                for b, _ in grads[0]:
                    for path in b.paths:
                        apart, what = aparts[rank][path][-1], f"{name}, rank {rank}: weight {path}"
                        if exact:
                            over = ((weights[path] - ref_w[path]).abs().reshape(-1) / apart).max()
                            assert over <= 1, f"{what} after {STEPS} steps {over:.2f} times its bound"
                        else:  # 8-bit, the same blocks: a code may move, from the same start
                            cap = adam_cap(shard_leaf(path, start[path], plan), STEPS, ADAM)
                            assert_codes_moved(weights[path], ref_w[path], apart, cap, what)
            for path, w, want in zip(weights, got_w, want_w):
                err = rel_err(w, want)
                assert bf16 or tol is None or err <= tol, f"{name}, rank {rank}: weight {path} off by {err:.2e}"
            if bf16:  # bf16 rounding is noise that AdamW turns into whole steps on the small biases: the whole rank
                for what, got, want in (("gradient", got_g, want_g), ("weights", got_w, want_w)):
                    err = rel_err(torch.cat(got), torch.cat(want))
                    assert err <= tol, f"{name}, rank {rank}: all the {what} off by {err:.2e}"
            seen |= set(weights)
            # the units handed over stage by stage, each at its stage's last backward
            actions = build_schedule(schedule, grid.pp, MICRO).ranks[pp_rank]
            order = [s for a, s in sorted(last_backwards(actions).items(), key=lambda kv: actions.index(kv[0]))]
            assert done == order * STEPS, f"{name}, rank {rank}: stages done in the order {done}, not {order}"
        assert seen == set(ref_grads[0]), f"{name}: leaves on no rank: {set(ref_grads[0]) - seen}"


def test_1x2x2_and_2x1x2_ddp_zero1_zero2_equal_one_process():
    check_world(4)


def test_2x2x2_zero1_zero2_and_8bit_adam_equal_one_process():
    check_world(8)


def test_three_replicas_1x2x3_and_2x1x3_equal_one_process():
    check_world(6)
