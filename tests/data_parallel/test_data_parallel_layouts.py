"""Data parallelism on the Llama class (``tiny-llama``: RMSNorm, rotary positions and no position table, 6 query
heads over 2 key/value heads, SwiGLU 100 wide, no biases), its head untied or tied to the embedding, and Qwen2's
q/k/v biases and Qwen3's per-head norms. ZeRO-3 runs the forward through ``run_units`` itself and must gather the
head's output matrix with the head, wherever the spec keeps it; DDP, ZeRO-1 and ZeRO-2 bucket and shard whatever
units the spec has; ZeRO-Offload (weight streaming, each rank's shard of masters and moments in host memory)
streams them. ZeRO-1, ZeRO-3 and ZeRO-Offload also clip every step by the global norm.

Two and three CPU ranks against plain autograd + ``torch.optim.AdamW`` on the whole batch (fp32), the
micro-batches' gradients summed in the stage's order: DDP, ZeRO-1 and ZeRO-2 sum each rank's micro-batches, then
the ranks' sums; ZeRO-3 sums each local micro-batch over the ranks (a reduce-scatter per micro-batch), then those
sums. ZeRO-Offload against one process's ``StreamTrainer`` on the whole batch, as ``test_data_parallel_streamed``.
Each side records the gradients its AdamW applied every step (clipped where it clips; ours as the inner AdamW
receives them, every rank's shards put together). The bounds (fp32), from the computation: the first loss and the
first step's gradients (where not clipped) within ``conftest.chain_rtol`` of the model's chain, every master within
what AdamW makes of the gradients each side applied (``conftest.adam_bounds``), each later loss and the validation
loss after the last step (ZeRO-3's gathered unit by unit, the head with its output matrix) within the first's bound
plus what that distance moves it, every clip's norm within those gradients' distance (``conftest.assert_norms``).
One forked world per size runs every check.

AdamW runs with eps = 1e-2, the references too, which keeps the weights' bound tight: a rounding delta of a gradient
then moves an update by at most about lr |delta| / eps (``adam_apart``'s (1 + rho) e / (sqrt(v-hat) - e + eps)).
With torch's 1e-8 an element whose gradient is near eps may flip its update's sign (up to 2 lr, which the bound
allows and so it would hardly tell a wrong gradient from a right one); past eps the update follows the gradient's
size, so a gradient off by a factor is off by that factor in the weights (Adam's sign-like step would hide it).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.stream.zero_offload import zero_offload_trainer
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from nanotrain.core.models import model_spec, run
from nanotrain.core.train.resident import TrainConfig
from nanotrain.stream.trainer import StreamConfig, StreamTrainer
from nanotrain.core.tree import Tree, named_leaves, tree_map
from tests.conftest import adam_bounds, assert_norms, chain_rtol, model_chain, rel_err, unclipped_apart
from tests.data_parallel.dp_cases import ADAM as ADAM_1E8, CPU32, buckets, reduced_grads, spied
from tests.stream.test_data_parallel_streamed import applied, split, spy_updates
from tests.core.test_trainer import LLAMA, QWEN2, QWEN3, TIED_LLAMA

BATCH, MICRO, SEQ, STEPS = 12, 2, 16, 3
ADAM = replace(ADAM_1E8, eps=1e-2)  # see the module docstring
MODELS = {"llama": LLAMA, "tied-llama": TIED_LLAMA, "qwen2": QWEN2, "qwen3": QWEN3}
CLIP = 0.05  # these models' gradient norms are ~1-3: every step clips
SCFG = StreamConfig(batch=BATCH, micro_batch=MICRO, on_host=1, tail=1)  # a block input in host memory, a tail block
# name: (the stage, clip norm); None: ZeRO-Offload (streamed)
RUNS = {"ddp": (DPConfig(zero=0, bucket_mb=0.01), None), "zero1": (DPConfig(zero=1, bucket_mb=0.01), None),
        "zero2": (DPConfig(zero=2), None), "zero3": (DPConfig(zero=3), None), "offload": (None, None),
        "zero1 clipped": (DPConfig(zero=1, bucket_mb=0.01), CLIP), "zero3 clipped": (DPConfig(zero=3), CLIP),
        "offload clipped": (None, CLIP)}

def batches(cfg) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, model_spec(cfg).vocab_size, (BATCH, SEQ), generator=g)
        y = x.roll(-1, dims=1)
        y[:, -3:] = -100
        y[1, :7] = -100  # ranks see different target counts
        out.append((x, y))
    return out


def reference(cfg, zero: int, world: int, clip: float | None) -> dict:
    """Autograd per micro-batch, the gradients summed in ``zero``'s order on ``world`` ranks, clipped by torch,
    torch's AdamW: the losses, the norms where clipped, each step's gradients AdamW applied (by path), the masters."""
    spec = model_spec(cfg)
    params = run.init_params(spec, seed=1)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    opt = torch.optim.AdamW(leaves, lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps, weight_decay=ADAM.weight_decay,
                            foreach=False)
    local = BATCH // world // MICRO  # micro-batches per rank: micro-batch j of rank r is r * local + j
    inner, outer = (range(world), range(local)) if zero == 3 else (range(local), range(world))
    losses, norms, applied_grads = [], [], []
    for x, y in batches(cfg):
        denom = int((y != -100).sum())
        micro = [run.loss(spec, params, xm, ym, denom=denom) for xm, ym in zip(x.split(MICRO), y.split(MICRO))]
        grads = [torch.autograd.grad(loss, leaves) for loss in micro]
        at = (lambda a, b: a * local + b) if zero == 3 else (lambda a, b: b * local + a)  # (inner, outer) -> index
        for i, t in enumerate(leaves):
            sums = [sum((grads[at(a, b)][i] for a in inner[1:]), grads[at(inner[0], b)][i]) for b in outer]
            t.grad = sum(sums[1:], sums[0])
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(leaves, clip).item())
        applied_grads.append({path: t.grad.clone() for path, t in named_leaves(params)})
        opt.step()
        losses.append(sum(loss.item() for loss in micro))
    return {"losses": losses, "norms": norms, "grads": applied_grads, "masters": tree_map(torch.Tensor.detach, params)}


def streamed_reference(cfg, clip: float | None) -> dict:
    """One process streaming the whole batch; each step's gradients as its AdamW's updates received them."""
    trainer = StreamTrainer(cfg, run.init_params(model_spec(cfg), seed=1), replace(SCFG, clip_norm=clip), ADAM, CPU32)
    seen, marks = [], []
    spy_updates(trainer.opt, seen)
    results = [(marks.append(len(seen)), trainer.step(x, y))[1] for x, y in batches(cfg)]
    masters = trainer.master_params()
    trainer.close()
    grads = [{p: g for paths, gs in step for p, g in zip(paths, gs)} for step in split(seen, marks)]
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results if r.clipped],
            "grads": grads, "masters": masters}


def steps(trainer, offload: bool, cfg) -> dict:
    """``STEPS`` steps: the results, and each step's gradients as this rank's inner AdamW received them, with what
    names them (ZeRO-Offload: ``spy_updates``' by shard piece; the others: ``spied``'s by bucket)."""
    grads, marks = [], []
    if offload:
        spy_updates(trainer.opt.inner, grads)
        results = [(marks.append(len(grads)), trainer.step(x, y))[1] for x, y in batches(cfg)]
        return {"results": results, "grads": split(grads, marks), "pieces": trainer.opt.pieces}
    spied(trainer, grads)
    results = [(grads.append([]), trainer.step(x, y))[1] for x, y in batches(cfg)]
    return {"results": results, "grads": grads, "buckets": buckets(trainer)}


def worker() -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "gloo", timeout_s=60)
    out = {}
    with ctx.guard():
        for model, cfg in MODELS.items():
            for name, (dcfg, clip) in RUNS.items():
                ctx.where = f"{model} {name}"
                tcfg = replace(SCFG, clip_norm=clip) if dcfg is None else TrainConfig(BATCH, MICRO, "every",
                                                                                      clip_norm=clip)
                make = zero_offload_trainer if dcfg is None else data_parallel_trainer
                trainer = make(cfg, run.init_params(model_spec(cfg), seed=1), tcfg, ADAM, CPU32, dcfg or DPConfig(),
                               ctx.grid.dp_group)
                r = steps(trainer, dcfg is None, cfg)
                results = r.pop("results")
                masters = trainer.master_params()  # collective: on the first rank only
                out[model, name] = {**r, "losses": [r.loss for r in results], "eval": trainer.eval_loss(*batches(cfg)[0]),
                                    "norms": [r.grad_norm for r in results if r.clipped],
                                    "masters": masters if ctx.rank == 0 else None,
                                    "segments": trainer.inner.weights.segments if dcfg and dcfg.zero == 3 else None}
                trainer.close()
    close_distributed(ctx)
    return out


def flat(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {path: g.reshape(-1) for path, g in grads.items()}


def check_row(runs: list[dict], ref: dict, cfg, dcfg: DPConfig | None, clip: float | None, what: str) -> None:
    """One row's every rank against its reference, from the gradients each side applied (module docstring)."""
    spec = model_spec(cfg)
    grads = [flat(applied(runs, s) if dcfg is None else reduced_grads(runs, dcfg.zero, s)) for s in range(STEPS)]
    ref_grads = [flat(g) for g in ref["grads"]]
    assert set(grads[0]) == set(ref_grads[0]), what
    loss_rtol = chain_rtol(model_chain(cfg, SEQ, BATCH * SEQ, "loss"))  # 1.9e-5: 2 blocks, head, the mean
    grad_rtol = chain_rtol(model_chain(cfg, SEQ, BATCH * SEQ))  # 3.7e-5: forward, backward, the sum over tokens
    for path, g in grads[0].items() if clip is None else ():  # clipped: the norms' first step bounds them below
        err = rel_err(g, ref_grads[0][path])
        assert err <= grad_rtol, f"{what}: first gradient of {path} {err:.2e} apart (bound {grad_rtol:.2e})"
    aparts, moved = adam_bounds(dict(named_leaves(run.init_params(spec, seed=1))), grads, ref_grads, ADAM)
    final = tree_map(lambda t: t.detach().clone().requires_grad_(), ref["masters"])
    val = run.loss(spec, final, *batches(cfg)[0])
    val.backward()  # the validation loss's gradient at the reference's masters: what their distance moves it by
    moved_val = sum(float((t.grad.double().abs().reshape(-1) * aparts[p][-1]).sum()) for p, t in named_leaves(final))
    sizes = [g.numel() for g in ref_grads[0].values()]
    for rank, r in enumerate(runs):
        for s, (a, b) in enumerate(zip(r["losses"], ref["losses"], strict=True)):
            assert abs(a - b) <= loss_rtol * abs(b) + moved[s], (what, rank, s, r["losses"], ref["losses"])
        assert abs(r["eval"] - val.item()) <= loss_rtol * val.item() + moved_val, (what, rank, r["eval"], val.item())
        assert len(r["norms"]) == len(ref["norms"]) == (STEPS if clip else 0), (what, rank)
        if clip:
            apart = unclipped_apart(grads, ref_grads, r["norms"], ref["norms"], clip)
            assert_norms(r["norms"], ref["norms"], apart, grad_rtol, sizes, len(runs))
    masters = runs[0]["masters"]
    assert [p for p, _ in named_leaves(masters)] == [p for p, _ in named_leaves(ref["masters"])], what
    for (path, a), (_, b) in zip(named_leaves(masters), named_leaves(ref["masters"])):
        over = ((a - b).abs().reshape(-1) / aparts[path][-1]).max()
        assert over <= 1, f"{what}: master {path} {over:.2f} times its bound"


@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_runs_the_llama_class_untied_tied_biased_and_normalised(world):
    per_rank = spawn(worker, world, start_method="fork", timeout_s=120)
    for model, cfg in MODELS.items():
        spec = model_spec(cfg)
        head = [spec.head_unit.name] + ([spec.embed_unit.name] if spec.head_weight in spec.embed_unit.paths else [])
        assert per_rank[0][model, "zero3"]["segments"][-1] == head, model  # the head gathers its output matrix
        for name, (dcfg, clip) in RUNS.items():
            ref = streamed_reference(cfg, clip) if dcfg is None else reference(cfg, dcfg.zero, world, clip)
            check_row([r[model, name] for r in per_rank], ref, cfg, dcfg, clip, f"{model} {name}")
