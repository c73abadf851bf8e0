"""3D checkpoints under ZeRO-1: every rank saves its shard of the masters and moments, resume continues exactly.

One 4-process world, tp 1 x pp 2 x dp 2 with ``Adam3D(zero=1)``, 32- and 8-bit moments, and bf16
compute with fp32 masters, then tp 2 x pp 1 x dp 2 with 8-bit moments: two steps, save, two more
steps; a fresh trainer (other initial weights) restored from the checkpoint makes the same last
two steps with bitwise equal losses and ends with bitwise equal weights. The checkpoint holds one
optimizer file per rank and the bucket layout in its manifest; its consolidated export holds the
fp32 masters, put back together from the ranks' pieces, of which every rank's weights at the save
are the rounding, and loads into ``transformers``.
A step reports where its time went (forward, backward, optimizer, waits), within the step's time.
The task saves a ZeRO-1 run and refuses to resume it at another dp.
"""
from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import GPT2LMHeadModel

from nanotrain.distributed import GridConfig, build_grid, close_distributed, init_distributed, spawn
from nanotrain.models import logits as lm_logits, model_spec, preset
from nanotrain.optim import AdamConfig, OffloadConfig
from nanotrain.parallel3d import Parallel3DTrainer, build_3d
from nanotrain.parallel3d.checkpoint import consolidate, export_hf, latest_3d, restore_3d, save_3d
from nanotrain.parallel3d.optimizer import Adam3D
from nanotrain.pipeline import build_schedule
from nanotrain.tensor_parallel.shard import TPPlan, shard_leaf
from nanotrain.tree import named_leaves
from tasks import train3d
from tests.conftest import SHAKESPEARE

CFG = preset("tiny", n_layer=4, n_embd=32, n_head=4, vocab_size=251, n_ctx=16)
BATCH, SEQ, MICRO, LR = 8, 16, 2, 1e-3
PP2, TP2 = GridConfig(tp=1, pp=2, dp=2), GridConfig(tp=2, pp=1, dp=2)
# name: (grid, moment bits, compute dtype)
RUNS = {"32": (PP2, 32, torch.float32), "8": (PP2, 8, torch.float32), "bf16": (PP2, 32, torch.bfloat16),
        "tp2 8": (TP2, 8, torch.float32)}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (4, BATCH, SEQ), generator=gen)
    targets = torch.randint(0, CFG.vocab_size, (4, BATCH, SEQ), generator=gen)
    targets[:, :3, :5] = -100
    return tokens, targets


def worker(run_dir: str) -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(tp=1, pp=2, dp=2), "gloo", timeout_s=120)
    tokens, targets = data()
    out = {}
    with ctx.guard():
        for name, (grid, bits, dtype) in RUNS.items():
            ctx.grid = build_grid(grid)

            def trainer(seed: int) -> Parallel3DTrainer:
                p3d = build_3d(ctx, CFG, build_schedule("1f1b", grid.pp, MICRO), SEQ, BATCH // (2 * MICRO), seed=seed,
                               dtype=dtype)
                ocfg = OffloadConfig(device="cpu", dtype=dtype, offload=False, state_bits=bits,
                                     block=64, min_8bit_numel=256)
                return Parallel3DTrainer(p3d, Adam3D(p3d, AdamConfig(lr=LR, eps=1e-6), ocfg, zero=1))

            first = trainer(seed=0)
            losses = [first.step(tokens[0], targets[0]).loss]
            start = time.perf_counter()
            result = first.step(tokens[1], targets[1])
            wall = time.perf_counter() - start
            losses.append(result.loss)
            split = [result.forward_s, result.backward_s, result.optimizer_s, result.copy_wait_s]
            saved = {path: t.detach().clone() for path, t in first.named_parameters()}
            ckpt = save_3d(f"{run_dir}/{name}", first)
            losses += [first.step(tokens[s], targets[s]).loss for s in (2, 3)]
            resumed = trainer(seed=1)
            restore_3d(resumed, latest_3d(f"{run_dir}/{name}"))
            assert resumed.step_count == 2 and resumed.opt.inner.steps == 2
            again = [resumed.step(tokens[s], targets[s]).loss for s in (2, 3)]
            same = all(torch.equal(a.detach(), b.detach())
                       for (_, a), (_, b) in zip(first.named_parameters(), resumed.named_parameters(), strict=True))
            plan = first.p3d.plan
            ranges = (plan.q_heads, plan.kv_heads, plan.neurons, plan.vocab, plan.padded_vocab)
            out[name] = (losses, again, same, saved, str(ckpt), ranges, split, wall)
            first.close()
            resumed.close()
    close_distributed(ctx)
    return out


def test_zero1_checkpoint_resumes_exactly_and_exports(tmp_path):
    per_rank = spawn(worker, 4, (str(tmp_path),), timeout_s=120, start_method="fork")
    for name, (grid, _, _) in RUNS.items():
        ckpt = tmp_path / name / "step-000002"
        for rank, result in enumerate(per_rank):
            losses, again, same, _, path, _, split, wall = result[name]
            assert path == str(ckpt)
            assert again == losses[2:], f"{name}, rank {rank}: resumed losses {again} != {losses[2:]}"
            assert same, f"{name}, rank {rank}: weights after the resumed steps differ"
            # the step-time split: every phase took time (two stages wait for each other), and they fit in the step
            assert all(t > 0 for t in split) and sum(split) <= wall, (rank, split, wall)
        manifest = json.loads((ckpt / "layout.json").read_text())
        assert manifest["zero"] == 1 and manifest["dp"] == 2 and manifest["step"] == 2
        assert set(manifest["buckets"]) == {f"tp{t}-pp{p}" for t in range(grid.tp) for p in range(grid.pp)}
        assert sorted(manifest["files"]) == sorted(p.name for p in ckpt.iterdir() if p.suffix == ".safetensors")
        assert len(manifest["files"]) == 2 + 4  # the replica's two shards, and one optimizer file per rank
        tree, cfg = consolidate(ckpt)
        leaves = dict(named_leaves(tree))
        for rank, result in enumerate(per_rank):
            plan = TPPlan(model_spec(CFG), None, False, *result[name][5])  # the rank's slices (the vocabulary padded)
            for path, w in result[name][3].items():  # the fp32 masters, of which the weights are the rounding
                master = shard_leaf(path, leaves[path], plan)
                assert master.dtype == torch.float32 and torch.equal(master.to(w.dtype), w), f"{name}: {path}"
        if name == "bf16":  # the export holds the masters, not the bf16 weights
            embedding = leaves[model_spec(CFG).embed_unit.paths[0]]
            assert not torch.equal(embedding, embedding.bfloat16().float())
    export_hf(tmp_path / "32" / "step-000002", tmp_path / "hf")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", attn_implementation="sdpa").eval()
    tree, cfg = consolidate(tmp_path / "32" / "step-000002")
    tokens = data()[0][0, :2]
    with torch.no_grad():
        assert (hf(input_ids=tokens).logits - lm_logits(tree, tokens, cfg)).abs().max().item() <= 1e-5


def test_train3d_saves_a_zero1_run_and_resumes_it_at_its_own_dp_only(tmp_path, capsys):
    if not SHAKESPEARE.exists():
        pytest.skip("needs ../shared/data/tinyshakespeare.txt")
    small = ["--n-layer", "2", "--seq", "16", "--microbatches", "2", "--micro-batch-size", "2", "--tokenizer", "bytes",
             "--data", str(SHAKESPEARE), "--log-every", "1", "--pp", "2", "--zero", "1", "--adam-bits", "8",
             "--out", str(tmp_path / "run")]
    train3d.main(["--dp", "2", "--steps", "1", *small])
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-000001"
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        train3d.main(["--dp", "1", "--steps", "2", "--resume", *small])
    assert info.value.code == 2
    assert "saved with another dp (2 vs this run's 1)" in capsys.readouterr().err
