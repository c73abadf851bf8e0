"""3D checkpoints in the one sharded format: every rank saves its pieces, resume continues exactly at the saved
layout and within the sums' rounding at another.

One 4-process world, tp 1 x pp 2 x dp 2 under ZeRO-1 and ZeRO-2 with 32- and 8-bit moments and bf16 compute
with fp32 masters, then tp 2 x pp 1 x dp 2 (ZeRO-1, 8-bit and 32-bit moments): two steps, save, two more
steps; a fresh trainer (other initial weights) restored from the checkpoint makes the same last two steps
with bitwise equal losses and ends with bitwise equal weights, and one at tp 1 x pp 1 x dp 4 under ZeRO-2
(another dp and pp, and from tp 2 another tp) continues the losses within the sums' rounding (their order differs);
8-bit moments saved at tp 2 are refused at tp 1 in one line. The exported masters are those of which
every rank's weights at the save are the rounding, and export loads into ``transformers``. A step reports
where its time went (forward, backward, optimizer, waits), within the step's time. A checkpoint of the
format before is refused with how to convert it. (The run's side, ``tasks.finetune --tp --pp``: test_finetune_3d.)

Three stages, whose middle one holds neither the embedding nor the head (so no tied leaf's group): one 6-process
world, tp 1 x pp 3 x dp 2 under ZeRO-2 and tp 2 x pp 3 x dp 1, each saved in the background (``Saver``, its
writers' group of its own) while its next step runs, resumes bitwise at its layout, and continues its losses at
the other within the chain's bound.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from transformers import GPT2LMHeadModel

from nanotrain.data_parallel import DPConfig
from nanotrain.checkpoint.background import Saver
from nanotrain.checkpoint.export import ExportConfig, export_checkpoint
from nanotrain.checkpoint.resume import check_resumable, load_masters, restore
from nanotrain.checkpoint.state import save_checkpoint
from nanotrain.distributed import GridConfig, build_grid, close_distributed, init_distributed, spawn
from nanotrain.core.models import init_params, logits as lm_logits, loss as lm_loss, model_spec, preset
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.compose import Parallel3DTrainer, build_3d
from nanotrain.pipeline import build_schedule
from nanotrain.tensor_parallel.shard import TPPlan, shard_leaf, unshard_leaf
from nanotrain.checkpoint.run_dir import find_checkpoint
from nanotrain.core.tree import get_path, set_path
from tests.conftest import assert_same_logits, chain_rtol, model_chain, moved_by
from weights.safetensors_io import CheckpointError

CFG = preset("tiny", n_layer=4, n_embd=32, n_head=4, vocab_size=251, n_ctx=16)
BATCH, SEQ, MICRO, LR = 8, 16, 2, 1e-3
PP2, TP2, DP4 = GridConfig(tp=1, pp=2, dp=2), GridConfig(tp=2, pp=1, dp=2), GridConfig(tp=1, pp=1, dp=4)
THREE_STAGES = {"pp3 dp2 zero2": (GridConfig(tp=1, pp=3, dp=2), 2), "tp2 pp3": (GridConfig(tp=2, pp=3, dp=1), 0)}
# name: (grid, zero, moment bits, compute dtype)
RUNS = {"zero1 32": (PP2, 1, 32, torch.float32), "zero2 8": (PP2, 2, 8, torch.float32),
        "zero1 bf16": (PP2, 1, 32, torch.bfloat16), "tp2 zero1 8": (TP2, 1, 8, torch.float32),
        "tp2 zero1 32": (TP2, 1, 32, torch.float32)}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (4, BATCH, SEQ), generator=gen)
    targets = torch.randint(0, CFG.vocab_size, (4, BATCH, SEQ), generator=gen)
    targets[:, :3, :5] = -100
    return tokens, targets


def make(ctx, grid: GridConfig, zero: int, bits: int, dtype: torch.dtype, seed: int) -> Parallel3DTrainer:
    ctx.grid = build_grid(grid, timeout=ctx.grid.timeout)
    p3d = build_3d(ctx, CFG, build_schedule("1f1b", grid.pp, MICRO), SEQ, BATCH // (grid.dp * MICRO), seed=seed,
                   dtype=dtype)
    ocfg = OffloadConfig(device="cpu", dtype=dtype, offload=False, state_bits=bits, block=64, min_8bit_numel=256)
    return Parallel3DTrainer(p3d, AdamConfig(lr=LR, eps=1e-6), ocfg, DPConfig(zero=zero, bucket_mb=0))


def worker(run_dir: str) -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(DP4, "gloo", timeout_s=120)
    tokens, targets = data()
    out = {}
    with ctx.guard():
        for name, (grid, zero, bits, dtype) in RUNS.items():
            first = make(ctx, grid, zero, bits, dtype, seed=0)
            losses = [first.step(tokens[0], targets[0]).loss]
            start = time.perf_counter()
            result = first.step(tokens[1], targets[1])
            wall = time.perf_counter() - start
            losses.append(result.loss)
            split = [result.forward_s, result.backward_s, result.optimizer_s, result.copy_wait_s]
            saved = {path: t.detach().clone() for path, t in first.named_parameters()}
            ckpt = save_checkpoint(f"{run_dir}/{name}", first)
            losses.append(first.step(tokens[2], targets[2]).loss)
            before_last = {path: t.detach().to(torch.float32, copy=True)
                           for path, t in first.named_parameters()}  # its pieces
            losses.append(first.step(tokens[3], targets[3]).loss)
            plan = first.p3d.plan
            ranges = (plan.q_heads, plan.kv_heads, plan.neurons, plan.vocab, plan.padded_vocab)
            resumed = make(ctx, grid, zero, bits, dtype, seed=1)
            restore(resumed, find_checkpoint(f"{run_dir}/{name}").path)
            assert resumed.step_count == 2 and resumed.opt.steps == 2
            again = [resumed.step(tokens[s], targets[s]).loss for s in (2, 3)]
            same = all(torch.equal(a.detach(), b.detach())
                       for (_, a), (_, b) in zip(first.named_parameters(), resumed.named_parameters(), strict=True))
            other = other_weights = None
            if bits == 32 or grid.tp == 1:  # 8-bit moments resume at their own tensor-parallel cut only
                moved = make(ctx, DP4, 2, bits, dtype, seed=1)
                restore(moved, ckpt)
                other = [moved.step(tokens[2], targets[2]).loss]
                other_weights = {path: t.detach().to(torch.float32, copy=True)  # every leaf whole
                                 for path, t in moved.named_parameters()}
                other.append(moved.step(tokens[3], targets[3]).loss)
                moved.close()
            out[name] = (losses, again, same, other, saved, str(ckpt), ranges, split, wall, before_last, other_weights)
            for t in (first, resumed):
                t.close()
    close_distributed(ctx)
    return out


def grads_at(weights: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """One process's fp32 gradient of the loss on a batch at ``weights`` (every leaf whole), by path."""
    tree = init_params(CFG)
    for path, t in weights.items():
        set_path(tree, path, t.clone().requires_grad_())
    lm_loss(tree, tokens, targets, CFG).backward()
    return {path: get_path(tree, path).grad for path in weights}


def moved_apart(per_rank: list[dict], name: str, grads: dict[str, torch.Tensor],
                whole: dict[str, torch.Tensor]) -> float:
    """How far the weights of run ``name``'s ranks before its last step (each rank's pieces), measured apart from
    ``whole`` (another layout's, every leaf whole), move a loss whose gradient there is ``grads``
    (``conftest.moved_by``; a piece on several ranks counted again: an upper bound)."""
    total = 0.0
    for result in per_rank:
        plan, mine = TPPlan(model_spec(CFG), None, False, *result[name][6]), result[name][9]
        total += moved_by({p: shard_leaf(p, grads[p], plan) for p in mine}, mine,
                          {p: shard_leaf(p, whole[p], plan) for p in mine})
    return total


def test_3d_checkpoint_resumes_exactly_at_its_layout_and_at_another(tmp_path):
    per_rank = spawn(worker, 4, (str(tmp_path),), timeout_s=150, start_method="fork")
    tokens, targets = data()
    for name, (grid, zero, bits, dtype) in RUNS.items():
        ckpt = tmp_path / name / "step-000002"
        for rank, result in enumerate(per_rank):
            losses, again, same, other, _, path, _, split, wall, _, _ = result[name]
            assert path == str(ckpt)
            assert again == losses[2:], f"{name}, rank {rank}: resumed losses {again} != {losses[2:]}"
            assert same, f"{name}, rank {rank}: weights after the resumed steps differ"
            if other is not None:
                # its first step from the same state at another layout: any reduction may reorder (the chain's
                # bound); the next plus what the two layouts' weights after that step, measured apart, move it
                # (conftest.moved_by at the other layout's weights: 8-bit codes and bf16 roundings included). With
                # bf16 compute the claim, not a bound: both layouts round the same fp32 sums (within their reorder,
                # ~1e-6) to bf16 (spacing 2^-8), so an activation flips by one bf16 step only where it lies within
                # that reorder of a rounding boundary, ~1e-6 / 2^-8 = 3e-4 of them: the loss ~3e-4 x 2^-8 = 1e-6
                # were they all to push it one way; 1e-5 claims they stay that rare (every rounding flipped would
                # be chain_rtol(..., torch.bfloat16), 1.9: no check)
                rtol = 1e-5 if dtype == torch.bfloat16 else chain_rtol(model_chain(CFG, SEQ, BATCH * SEQ, "loss"))
                whole = {p: unshard_leaf(p, [t], model_spec(CFG)) for p, t in result[name][10].items()}  # unpadded
                moved = moved_apart(per_rank, name, grads_at(whole, tokens[3], targets[3]), whole)
                assert abs(other[0] - losses[2]) <= rtol * losses[2], (name, other, losses)
                assert abs(other[1] - losses[3]) <= rtol * losses[3] + moved, (name, other, losses, moved)
            # the step-time split: every phase took time (two stages wait for each other), and they fit in the step
            assert all(t > 0 for t in split) and sum(split) <= wall, (rank, split, wall)
        manifest = json.loads((ckpt / "manifest.json").read_text())
        assert manifest["layout"] == {"tp": grid.tp, "pp": grid.pp, "dp": 2, "zero": zero} and manifest["step"] == 2
        assert manifest["block"] == (64 if bits == 8 else None)
        assert sorted(manifest["files"]) == sorted(p.name for p in ckpt.iterdir() if p.suffix == ".safetensors")
        assert len(manifest["files"]) == 4  # ZeRO: every rank writes its pieces
        if bits == 8 and grid.tp == 2:
            with pytest.raises(CheckpointError, match=r"8-bit moments quantized per leaf as held at tp 2 in blocks "
                                                      r"of 64: they resume only with that cut"):
                check_resumable(ckpt, 1, 64)
        leaves = load_masters(ckpt)
        for rank, result in enumerate(per_rank):
            plan = TPPlan(model_spec(CFG), None, False, *result[name][6])  # the rank's slices (the vocabulary padded)
            for path, w in result[name][4].items():  # the fp32 masters, of which the weights are the rounding
                master = shard_leaf(path, leaves[path], plan)
                assert master.dtype == torch.float32 and torch.equal(master.to(w.dtype), w), f"{name}: {path}"
        if name == "zero1 bf16":  # the export holds the masters, not the bf16 weights
            embedding = leaves[model_spec(CFG).embed_unit.paths[0]]
            assert not torch.equal(embedding, embedding.bfloat16().float())
    export_checkpoint(tmp_path / "zero1 32" / "step-000002", tmp_path / "hf", ecfg=ExportConfig(torch.float32))
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", attn_implementation="sdpa").eval()
    tree = init_params(CFG)
    for path, t in load_masters(tmp_path / "zero1 32" / "step-000002").items():
        set_path(tree, path, t)
    tokens = data()[0][0, :2]
    with torch.no_grad():
        assert_same_logits(lm_logits(tree, tokens, CFG), hf(input_ids=tokens).logits, CFG)


def test_a_checkpoint_of_the_format_before_is_refused_with_how_to_convert_it(tmp_path):
    old = tmp_path / "old" / "step-000001"  # a 3D checkpoint before the sharded format: a layout.json
    old.mkdir(parents=True)
    (old / "layout.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"older sharded format, which no longer resumes: convert it with "
                                              r"`python -m tasks.consolidate .* --out HF`, then start from it with "
                                              r"`--weights HF`"):
        check_resumable(old)


def three_stages(run_dir: str) -> dict:
    """Each layout of ``THREE_STAGES``: two steps, a background save, the third step while it is written, the fourth;
    a fresh trainer resumed at the layout makes the last two again; the other layout's checkpoint continues here."""
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=6), "gloo", timeout_s=60)
    tokens, targets = data()
    out = {}
    with ctx.guard():
        for name, (grid, zero) in THREE_STAGES.items():
            first = make(ctx, grid, zero, 32, torch.float32, seed=0)
            losses = [first.step(tokens[s], targets[s]).loss for s in (0, 1)]
            saver = Saver(Path(run_dir) / name)
            ckpt = saver.save(first, None)
            losses += [first.step(tokens[s], targets[s]).loss for s in (2, 3)]  # the third beside the write
            saver.wait()
            resumed = make(ctx, grid, zero, 32, torch.float32, seed=1)
            restore(resumed, ckpt)
            again = [resumed.step(tokens[s], targets[s]).loss for s in (2, 3)]
            same = all(torch.equal(a.detach(), b.detach())
                       for (_, a), (_, b) in zip(first.named_parameters(), resumed.named_parameters(), strict=True))
            out[name] = (losses, again, same, str(ckpt), bool(first.pipe.tied), first.grid.pp_rank)
            for t in (first, resumed):
                t.close()
        for (name, (grid, zero)), other in zip(THREE_STAGES.items(), reversed(THREE_STAGES)):
            moved = make(ctx, grid, zero, 32, torch.float32, seed=1)
            restore(moved, out[other][3])
            out[name] += (moved.step(tokens[2], targets[2]).loss,)
            moved.close()
    close_distributed(ctx)
    return out


def test_three_stages_save_in_the_background_and_resume(tmp_path):
    per_rank = spawn(three_stages, 6, (str(tmp_path),), timeout_s=120, start_method="fork")
    rtol = chain_rtol(model_chain(CFG, SEQ, BATCH * SEQ, "loss"))  # another layout: any reduction may reorder
    for name, (grid, zero) in THREE_STAGES.items():
        for rank, result in enumerate(per_rank):
            losses, again, same, path, tied, pp_rank, crossed = result[name]
            assert path == str(tmp_path / name / "step-000002")
            assert tied == (pp_rank != 1), (name, rank, tied)  # the middle stage is in no tied leaf's group
            assert again == losses[2:] and same, (name, rank, again, losses)  # bitwise at the saved layout
            other = per_rank[rank][next(n for n in THREE_STAGES if n != name)][0]  # same rank, the other layout
            assert abs(crossed - other[2]) <= rtol * other[2], (name, rank, crossed, other)
        manifest = json.loads((tmp_path / name / "step-000002" / "manifest.json").read_text())
        assert manifest["layout"] == {"tp": grid.tp, "pp": 3, "dp": grid.dp, "zero": zero}
        assert len(manifest["files"]) == 6  # every rank writes pieces of its own
