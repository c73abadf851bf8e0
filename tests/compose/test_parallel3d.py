"""3D parallelism (tensor x pipeline x data) equals one process on the same global batch (fp32, CPU, gloo).

One 8-process world runs several layouts in turn (grids rebuilt inside it): 2x2x2 with sequence
parallelism and the interleaved schedule, 1x2x4 with recomputed blocks under another grid order,
2x4x1 under ZB-H1 (the TP linears' weight gradients deferred to W) and a third order, 4x1x2 with
GPipe, sequence parallelism and sub-layers; and a Llama-class model (6 query heads over 2 key/value heads,
rotary positions, SwiGLU 100 wide, an untied head) on 2x2x2 with sequence parallelism and sub-layers, and on
4x1x2 where each key/value head is held by 2 of the 4 TP ranks (their rows' gradients summed over those 2). Each
makes three AdamW steps (nanotrain's, through the data-parallel engine, DDP); against the single process
on the whole batch with ``torch.optim.AdamW``: the forward-only validation loss before them, every step's
loss, every reduced gradient of the first step (each rank's shard against that shard of the full gradient)
and the weights after the last step: losses and gradients within ``conftest.chain_rtol`` of the
reductions they come out of, each weight within what AdamW makes of the gradients each side applied at
every step, and each later loss within what that distance moves it (``conftest.adam_bounds``). Targets
hold -100s unevenly, so the replicas see different counts of valid targets and only the global
denominator makes the mean exact.

AdamW runs with eps=1e-6 (lr 1e-3): with the default 1e-8 a gradient that is rounding noise (the key
bias's is zero in exact arithmetic) divided by eps is a full step of either sign, and the per-element
bound allows that move wherever the gradients differ by eps: 1e-6 keeps the bound meaningful.
"""
from __future__ import annotations

import pytest
import torch
from transformers import GPT2LMHeadModel

from nanotrain.data_parallel import DPConfig
from nanotrain.checkpoint.export import ExportConfig, export_checkpoint
from nanotrain.checkpoint.resume import load_masters, restore
from nanotrain.checkpoint.state import save_checkpoint
from nanotrain.distributed import GridConfig, build_grid, close_distributed, init_distributed, spawn
from nanotrain.core.models import init_params, logits as lm_logits, loss as lm_loss, model_spec, preset
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.compose import Parallel3DTrainer, build_3d
from nanotrain.pipeline import build_schedule
from nanotrain.checkpoint.run_dir import find_checkpoint
from nanotrain.tensor_parallel.shard import TPPlan, shard_leaf
from nanotrain.core.tree import named_leaves, set_path, tree_map
from tests.conftest import adam_apart, adam_bounds, chain_rtol, model_chain, rel_err

CFG = preset("tiny", n_layer=4, n_embd=32, n_head=4, vocab_size=251, n_ctx=16)
LLAMA = preset("tiny-llama", n_layer=4, vocab_size=251)
BATCH, SEQ, MICRO, STEPS, LR, EPS = 16, 16, 4, 3, 1e-3, 1e-6
ADAM = AdamConfig(lr=LR, eps=EPS, weight_decay=0.01)  # torch.optim.AdamW's defaults otherwise
FP32 = OffloadConfig(device="cpu", dtype=torch.float32, offload=False)
# name: (grid, schedule, virtual stages, sequence parallel, options of build_3d)
LAYOUTS = {
    "2x2x2 interleaved sp": (GridConfig(tp=2, pp=2, dp=2), "interleaved-1f1b", 2, True, {}),
    "1x2x4 1f1b recompute pp-dp-tp": (GridConfig(tp=1, pp=2, dp=4, order=("pp", "dp", "tp")), "1f1b", 1, False,
                                      {"recompute": True}),
    "2x4x1 zb-h1 tp-pp-dp": (GridConfig(tp=2, pp=4, dp=1, order=("tp", "pp", "dp")), "zb-h1", 1, False, {}),
    "4x1x2 gpipe sp sublayers": (GridConfig(tp=4, pp=1, dp=2), "gpipe", 1, True, {"sublayers": True}),
}
LLAMA_LAYOUTS = {"2x2x2 1f1b sp sublayers": (GridConfig(tp=2, pp=2, dp=2), "1f1b", 1, True, {"sublayers": True}),
                 "4x1x2 gpipe sp, key/value heads replicated": (GridConfig(tp=4, pp=1, dp=2), "gpipe", 1, True, {})}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (STEPS, BATCH, SEQ), generator=gen)
    targets = torch.randint(0, CFG.vocab_size, (STEPS, BATCH, SEQ), generator=gen)
    targets[:, :5, :7] = -100  # the first replicas lose more targets than the others
    targets[:, -1, -1] = -100
    return tokens, targets


def worker(cfg=CFG, layouts=LAYOUTS) -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=8), "gloo", timeout_s=120)
    tokens, targets = data()
    out = {}
    with ctx.guard():
        for name, (grid, schedule, virtual, sp, options) in layouts.items():
            ctx.grid = build_grid(grid, timeout=ctx.grid.timeout)
            p3d = build_3d(ctx, cfg, build_schedule(schedule, grid.pp, MICRO, virtual), SEQ,
                           BATCH // (grid.dp * MICRO), sequence_parallel=sp, **options)
            trainer = Parallel3DTrainer(p3d, ADAM, FP32, DPConfig(bucket_mb=0))
            evaluated = trainer.eval_loss(tokens[0], targets[0])  # forward only: the first step's loss
            opt, losses, grads = trainer.opt, [], []  # DDP: every bucket's whole reduced gradient, every step
            for s in range(STEPS):
                losses.append(trainer.step(tokens[s], targets[s]).loss)
                grads.append({path: g.clone() for b in opt.buckets for path, g in b.views(opt.reduced(b)).items()})
            weights = {path: t.detach().clone() for path, t in trainer.named_parameters()}
            trainer.close()
            plan = p3d.plan
            ranges = (plan.q_heads, plan.kv_heads, plan.neurons, plan.vocab, plan.padded_vocab)
            out[name] = ([evaluated] + losses, grads, weights, ranges)
    close_distributed(ctx)
    return out


def reference(steps: int = STEPS, cfg=CFG) -> tuple[list[float], list[dict], dict[str, torch.Tensor]]:
    """One process, the whole batch: each step's loss and gradients, the last weights."""
    params = tree_map(lambda t: t.requires_grad_(), init_params(cfg, seed=0))
    opt = torch.optim.AdamW([t for _, t in named_leaves(params)], lr=LR, eps=EPS)
    tokens, targets = data()
    losses, grads = [], []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(params, tokens[s], targets[s], cfg)
        loss.backward()
        grads.append({path: t.grad.clone() for path, t in named_leaves(params)})
        opt.step()
        losses.append(loss.item())
    return losses, grads, {path: t.detach().clone() for path, t in named_leaves(params)}


@pytest.mark.parametrize("cfg,layouts", [(CFG, LAYOUTS), (LLAMA, LLAMA_LAYOUTS)], ids=["gpt2", "llama"])
def test_3d_layouts_equal_one_process(cfg, layouts):
    per_rank = spawn(worker, 8, (cfg, layouts), timeout_s=170, start_method="fork")
    ref_losses, ref_grads, ref_weights = reference(cfg=cfg)
    loss_rtol = chain_rtol(model_chain(cfg, SEQ, BATCH * SEQ, "loss"))  # 2.9e-5 (gpt2), 3.1e-5 (llama)
    grad_rtol = chain_rtol(model_chain(cfg, SEQ, BATCH * SEQ))  # 6.0e-5, 6.4e-5
    start = dict(named_leaves(init_params(cfg, seed=0)))
    for name, (_, _, _, sp, _) in layouts.items():
        seen, bounds, moved = set(), [], [0.0] * STEPS
        for _, grads, weights, ranges in (result[name] for result in per_rank):  # conftest.adam_bounds of each rank
            plan = TPPlan(model_spec(cfg), None, sp, *ranges)  # the rank's slices; no group is needed to cut tensors
            mine = [{path: shard_leaf(path, g[path], plan) for path in weights} for g in ref_grads]
            w0 = {path: shard_leaf(path, start[path], plan) for path in weights}
            bounds.append((plan, mine, *adam_bounds(w0, grads, mine, ADAM)))
            moved = [a + b for a, b in zip(moved, bounds[-1][-1])]  # replicas counted again: an upper bound
        for rank, result in enumerate(per_rank):
            losses, grads, weights, _ = result[name]
            plan, mine, aparts, _ = bounds[rank]
            for s, (a, b) in enumerate(zip(losses, ref_losses[:1] + ref_losses, strict=True)):  # eval, then steps
                bound = loss_rtol * abs(b) + moved[max(s - 1, 0)]  # after s - 1 steps of AdamW
                assert abs(a - b) <= bound, f"{name}, rank {rank}, {s and f'step {s}' or 'eval'}: {a} != {b}"
            for path, g in grads[0].items():
                err = rel_err(g, mine[0][path])
                assert err <= grad_rtol, f"{name}, rank {rank}: gradient of {path} off by {err:.2e}"
            for path, w in weights.items():  # each element within what AdamW makes of the gradients each side applied
                over = ((w - shard_leaf(path, ref_weights[path], plan)).abs().reshape(-1) / aparts[path][-1]).max()
                assert over <= 1, f"{name}, rank {rank}: weight {path} after {STEPS} steps {over:.2f} times its bound"
            seen |= set(grads[0])
        assert seen == set(ref_grads[0]), f"{name}: leaves on no rank: {set(ref_grads[0]) - seen}"


def resume_worker(run_dir: str) -> tuple[list[float], list[float]]:
    """tp 2 x pp 2 with sequence parallelism: one step, save, two steps; then a fresh trainer (other
    initial weights) restored from the checkpoint makes the same two steps."""
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(tp=2, pp=2), "gloo", timeout_s=120)
    tokens, targets = data()
    with ctx.guard():
        def trainer(seed: int) -> Parallel3DTrainer:
            p3d = build_3d(ctx, CFG, build_schedule("1f1b", 2, MICRO), SEQ, BATCH // MICRO, sequence_parallel=True,
                           seed=seed)
            return Parallel3DTrainer(p3d, ADAM, FP32)

        first = trainer(seed=0)
        first.step(tokens[0], targets[0])
        save_checkpoint(run_dir, first)
        straight = [first.step(tokens[s], targets[s]).loss for s in (1, 2)]
        resumed = trainer(seed=1)
        assert restore(resumed, find_checkpoint(run_dir).path) is None  # 3D draws batches by step
        assert resumed.step_count == 1
        again = [resumed.step(tokens[s], targets[s]).loss for s in (1, 2)]
    close_distributed(ctx)
    return straight, again


def test_save_resume_and_export_to_transformers(tmp_path):
    per_rank = spawn(resume_worker, 4, (str(tmp_path),), timeout_s=120, start_method="fork")
    for straight, again in per_rank:
        assert straight == again, (straight, again)  # bitwise: the same state and the same batches
    ckpt = tmp_path / "step-000001"
    assert (tmp_path / "latest").read_text().strip() == ckpt.name
    tree = init_params(CFG, seed=1)
    for path, t in load_masters(ckpt).items():
        set_path(tree, path, t)
    _, ref_grads, ref_weights = reference(steps=1)
    start, grad_rtol = dict(named_leaves(init_params(CFG, seed=0))), chain_rtol(model_chain(CFG, SEQ, BATCH * SEQ))
    for path, w in named_leaves(tree):  # one AdamW step on a gradient within grad_rtol of the whole leaf's
        g = ref_grads[0][path]
        bound = adam_apart([g.reshape(-1)], [grad_rtol * g.norm().item()], start[path].reshape(-1), ADAM)[-1]
        over = ((w - ref_weights[path]).abs().reshape(-1) / bound).max()
        assert over <= 1, f"saved {path} {over:.2f} times its bound"
    export_checkpoint(ckpt, tmp_path / "hf", ecfg=ExportConfig(torch.float32))
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", attn_implementation="sdpa").eval()
    tokens = data()[0][0, :2]
    with torch.no_grad():
        err = rel_err(hf(input_ids=tokens).logits, lm_logits(tree, tokens, CFG))
        assert err <= chain_rtol(model_chain(CFG, SEQ, what="logits")), err  # 2.5e-5: two forwards' orders
