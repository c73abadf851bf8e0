"""One checkpoint format, any layout back (issue 39, item 3): a ZeRO-1, -2 and -3 checkpoint saved at 3 ranks
resumes as one process, as DDP at 2 ranks, and at the 3D layouts tp 2 and pp 2; a one-process checkpoint
resumes under ZeRO at 2 ranks and at tp 2; and a checkpoint of the old one-process layout (a Hugging Face
folder and ``optimizer.safetensors``) resumes through the one reader. Each continues the single-process run's
losses.

Bounds (fp32), from the computation: each loss within its own bound from the same weights (``LOSS_RTOL``) plus
what the weights' distance moves it, from the gradients each side applied at every step, the checkpoint's first
included (``conftest.adam_bounds``; recorded as each AdamW got them; measured <= 7.6e-8 relative).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanotrain.checkpoint.resume import load_masters, restore
from nanotrain.checkpoint.state import save_checkpoint
from nanotrain.compose import Parallel3DTrainer, build_3d
from nanotrain.core.models import init_params, model_spec, preset
from nanotrain.core.models.run import tree_from
from nanotrain.core.tree import named_leaves
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.data import DataPosition
from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.distributed import GridConfig, build_grid, close_distributed, init_distributed, spawn
from nanotrain.pipeline import build_schedule
from nanotrain.tensor_parallel.shard import TPPlan, shard_leaf
from tests.conftest import adam_bounds, chain_rtol, model_chain
from tests.data_parallel.dp_cases import SAME_LOSS_RTOL, batches, buckets, reduced_grads, spied

CFG = preset("tiny", n_layer=4, n_embd=32, n_head=4, vocab_size=512, n_ctx=16)  # no dropout: 3D runs it too
ADAM = AdamConfig(lr=1e-3, eps=1e-6, weight_decay=0.1)
OCFG = OffloadConfig(device="cpu", dtype=torch.float32, offload=False, state_bits=32)
BATCH, MICRO, SEQ = 12, 2, 16  # those of ``batches``
TCFG = TrainConfig(batch=BATCH, micro_batch=MICRO, recompute="every")
# the loss of the same weights: at 3D layouts any of its sums may reorder (the chain's bound, 3e-5); in one process
# or data parallel, the same micro-batches' kernels, only their sum reordering (the data-parallel tests', 4e-7)
LOSS_RTOL = chain_rtol(model_chain(CFG, SEQ, BATCH * SEQ, "loss"))


def spied_resident(trainer: ResidentTrainer, grads: list[dict]) -> ResidentTrainer:
    """``trainer``'s every applied gradient by path added to ``grads[-1]``: the caller appends a dict a step."""
    opt, real = trainer.opt, trainer.opt.update
    opt.update = lambda unit, gs: (grads[-1].update({p: g.clone() for p, g in zip(opt._unit(unit).paths, gs)}),
                                   real(unit, gs))[-1]
    return trainer


def one_process(ckpt=None) -> tuple[list[float], list[dict]]:
    """The single process's losses and applied gradients: every step from the start, or the steps after ``ckpt``."""
    trainer, grads = ResidentTrainer(CFG, init_params(CFG, seed=1), TCFG, ADAM, OCFG), []
    spied_resident(trainer, grads)
    done = 0 if ckpt is None else (restore(trainer, ckpt), trainer.step_count)[1]
    losses = [(grads.append({}), trainer.step(x, y).loss)[1] for x, y in batches()[done:]]
    trainer.close()
    return losses, grads


def data_parallel(zero: int, group, seed: int = 2) -> object:
    """A data-parallel trainer from weights of ``seed`` (1: the single process's; others: what a restore replaces)."""
    return data_parallel_trainer(CFG, init_params(CFG, seed=seed), TCFG, ADAM, OCFG,
                                 DPConfig(zero=zero, bucket_mb=0.05), group)


def three_d(ctx, grid: GridConfig) -> Parallel3DTrainer:
    ctx.grid = build_grid(grid, timeout=ctx.grid.timeout)
    p3d = build_3d(ctx, CFG, build_schedule("1f1b", grid.pp, MICRO), SEQ, BATCH // (grid.dp * MICRO), seed=3)
    return Parallel3DTrainer(p3d, ADAM, OCFG, DPConfig(zero=0, bucket_mb=0))


def resumed(trainer, ckpt) -> dict:
    """Losses, applied gradients (as ``spied`` records them) and buckets of the steps after ``ckpt``; for a 3D
    trainer, also its TP plan's ranges (to shard the reference's leaves as this rank holds them)."""
    restore(trainer, ckpt)
    assert trainer.step_count == 1
    grads = []
    spied(trainer, grads)
    losses = [(grads.append([]), trainer.step(x, y).loss)[1] for x, y in batches()[1:]]
    plan = getattr(getattr(trainer, "p3d", None), "plan", None)
    ranges = plan and (plan.q_heads, plan.kv_heads, plan.neurons, plan.vocab, plan.padded_vocab)
    out = {"losses": losses, "grads": grads, "buckets": buckets(trainer), "ranges": ranges}
    trainer.close()
    return out


def save_at_three(run: str) -> dict:
    """ZeRO-1, -2 and -3 at 3 ranks: one step, saved; its gradients as each rank's AdamW got them."""
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=3), "gloo", timeout_s=60)
    out = {}
    with ctx.guard():
        for zero in (1, 2, 3):
            grads = [[]]
            trainer = spied(data_parallel(zero, dist.group.WORLD, seed=1), grads)
            trainer.step(*batches()[0])
            save_checkpoint(f"{run}/zero{zero}", trainer, DataPosition(0, 12))
            out[zero] = {"grads": grads, "buckets": buckets(trainer)}
            trainer.close()
    close_distributed(ctx)
    return out


def resume_at_two(run: str) -> dict:
    """Each ZeRO checkpoint as DDP at 2 ranks, at tp 2 and at pp 2; the one-process one under ZeRO-2 and at tp 2."""
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=2), "gloo", timeout_s=60)
    out = {}
    with ctx.guard():
        for zero in (1, 2, 3):
            ckpt = f"{run}/zero{zero}/step-000001"
            out[f"zero{zero} ddp"] = resumed(data_parallel(0, dist.group.WORLD), ckpt)
            out[f"zero{zero} tp2"] = resumed(three_d(ctx, GridConfig(tp=2, pp=1, dp=1)), ckpt)
            out[f"zero{zero} pp2"] = resumed(three_d(ctx, GridConfig(tp=1, pp=2, dp=1)), ckpt)
        out["one zero2"] = resumed(data_parallel(2, dist.group.WORLD), f"{run}/one/step-000001")
        out["one tp2"] = resumed(three_d(ctx, GridConfig(tp=2, pp=1, dp=1)), f"{run}/one/step-000001")
    close_distributed(ctx)
    return out


def assert_continues(losses: list[float], grads: list[list[dict]], ranges: list, first: dict, ref: tuple,
                     what: str, rtol: float = SAME_LOSS_RTOL) -> None:
    """A resumed run's ``losses`` against the reference's (``ref``: losses and applied gradients from the start),
    from a checkpoint made with gradients ``first`` (whole, by path), the run's own after it ``grads`` (by rank,
    by step, by path: each rank's leaves, TP-sharded by its plan's ``ranges`` where it has one), replicas
    counted again; ``rtol``: the loss's own bound from the same weights."""
    ref_losses, ref_grads = ref
    start, moved = dict(named_leaves(init_params(CFG, seed=1))), [0.0] * len(ref_grads)
    for rank_grads, rng in zip(grads, ranges, strict=True):
        plan = rng and TPPlan(model_spec(CFG), None, False, *rng)
        paths = rank_grads[0].keys()

        def mine(g: dict) -> dict:
            return {p: shard_leaf(p, g[p], plan) if plan else g[p] for p in paths}

        rank_moved = adam_bounds(mine(start), [mine(first)] + rank_grads, [mine(g) for g in ref_grads], ADAM)[1]
        moved = [a + b for a, b in zip(moved, rank_moved)]
    assert len(losses) == len(ref_losses) - 1, (what, losses)
    for s, (a, b) in enumerate(zip(losses, ref_losses[1:]), 1):  # each after s steps of AdamW
        assert abs(a - b) <= rtol * abs(b) + moved[s], (what, s, a, b, moved[s])


def by_path(runs: list[dict], zero: int) -> list[dict]:
    """Each step's applied gradients by path, put together from every rank's ``spied`` record (ZeRO: shards)."""
    return [reduced_grads(runs, zero, s) for s in range(len(runs[0]["grads"]))]


def test_a_checkpoint_of_any_layout_resumes_at_any_other(tmp_path):
    ref = one_process()
    first, first_grads = ResidentTrainer(CFG, init_params(CFG, seed=1), TCFG, ADAM, OCFG), [{}]
    spied_resident(first, first_grads)
    first.step(*batches()[0])
    save_checkpoint(tmp_path / "one", first, DataPosition(0, 12))
    first.close()
    savers = spawn(save_at_three, 3, (str(tmp_path),), start_method="fork", timeout_s=120)
    firsts = {"one": first_grads[0]} | {f"zero{z}": by_path([r[z] for r in savers], z)[0] for z in (1, 2, 3)}
    for zero in (1, 2, 3):  # as one process
        losses, grads = one_process(tmp_path / f"zero{zero}" / "step-000001")
        assert_continues(losses, [grads], [None], firsts[f"zero{zero}"], ref, f"zero{zero} as one process")
    per_rank = spawn(resume_at_two, 2, (str(tmp_path),), start_method="fork", timeout_s=120)
    for name in per_rank[0]:
        runs = [r[name] for r in per_rank]
        if runs[0]["ranges"] is None:  # data parallel: each step's whole gradient, from the ranks' records
            grads, ranges, rtol = [by_path(runs, 2 if name.endswith("zero2") else 0)], [None], SAME_LOSS_RTOL
        else:  # 3D: each rank's leaves
            grads, ranges, rtol = [by_path([r], 0) for r in runs], [r["ranges"] for r in runs], LOSS_RTOL
        for r in runs:
            assert_continues(r["losses"], grads, ranges, firsts[name.split()[0]], ref, name, rtol)


def test_the_old_one_process_layout_resumes_through_the_one_reader(tmp_path):
    """Written as the one-process writer before the one format wrote it: the model file, ``optimizer.safetensors``
    (``master.<path>``, moments, step counts), ``trainer.json``; no manifest."""
    from safetensors.torch import save_file

    from weights import save_hf

    trainer = ResidentTrainer(CFG, init_params(CFG, seed=1), TCFG, ADAM, OCFG)
    trainer.step(*batches()[0])
    old = tmp_path / "step-000001"
    save_hf(trainer.master_params(), CFG, old, max_shard_bytes=None)
    save_file({k: v.contiguous() for k, v in trainer.state_dict().items()}, old / "optimizer.safetensors")
    (old / "trainer.json").write_text('{"step": 1, "data_position": {"epoch": 0, "index": 12}, "meta": {}}')
    saved = {k.removeprefix("master."): t.clone() for k, t in trainer.state_dict().items() if k.startswith("master.")}
    expected = [trainer.step(x, y).loss for x, y in batches()[1:]]
    trainer.close()
    masters = load_masters(old)
    assert masters.keys() == saved.keys() and all(torch.equal(masters[p], saved[p]) for p in saved)
    again = ResidentTrainer(CFG, tree_from(model_spec(CFG), load_masters(old).items()), TCFG, ADAM, OCFG)
    assert restore(again, old) == DataPosition(0, 12) and again.step_count == 1
    assert [again.step(x, y).loss for x, y in batches()[1:]] == expected  # bit for bit: the same state
    again.close()
