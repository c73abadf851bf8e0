"""Data parallelism on a model that is not GPT-2 (``tests.llama_like``: RMSNorm, rotary positions and no
position table, grouped-query attention, SwiGLU, no biases), its head untied or tied to the embedding. ZeRO-3
runs the forward through ``run_units`` itself and must gather the head's output matrix with the head, wherever
the spec keeps it; DDP and ZeRO-2 bucket and shard whatever units the spec has.

Two CPU ranks against plain autograd + ``torch.optim.AdamW`` on the whole batch (fp32), the micro-batches'
gradients summed in the stage's order: DDP and ZeRO-2 sum each rank's micro-batches, then the ranks' sums;
ZeRO-3 sums each local micro-batch over the ranks (a reduce-scatter per micro-batch), then those sums. Same
terms in the same order: every loss and every master within 1e-6 relative (norm-wise per tensor).
"""
from __future__ import annotations

import torch

from nanotrain.data_parallel import DPConfig, data_parallel_trainer
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from nanotrain.models import run
from nanotrain.models.spec import ModelSpec
from nanotrain.train.resident import TrainConfig
from nanotrain.tree import named_leaves
from tests.conftest import rel_err
from tests.llama_like import llama_like
from tests.test_data_parallel import ADAM, CPU32

BATCH, MICRO, WORLD, STEPS = 8, 2, 2, 3
STAGES = {"ddp": DPConfig(zero=0, bucket_mb=0.01), "zero2": DPConfig(zero=2), "zero3": DPConfig(zero=3)}


def batches(spec: ModelSpec) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, spec.vocab_size, (BATCH, 16), generator=g)
        y = x.roll(-1, dims=1)
        y[:, -3:] = -100
        y[1, :7] = -100  # ranks see different target counts
        out.append((x, y))
    return out


def reference(spec: ModelSpec, zero: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Autograd per micro-batch, the gradients summed in ``zero``'s order on ``WORLD`` ranks, torch's AdamW."""
    params = run.init_params(spec, seed=1)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    opt = torch.optim.AdamW(leaves, lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps, weight_decay=ADAM.weight_decay,
                            foreach=False)
    local = BATCH // WORLD // MICRO  # micro-batches per rank: micro-batch j of rank r is r * local + j
    inner, outer = (range(WORLD), range(local)) if zero == 3 else (range(local), range(WORLD))
    losses = []
    for x, y in batches(spec):
        denom = int((y != -100).sum())
        micro = [run.loss(spec, params, xm, ym, denom=denom) for xm, ym in zip(x.split(MICRO), y.split(MICRO))]
        grads = [torch.autograd.grad(loss, leaves) for loss in micro]
        at = (lambda a, b: a * local + b) if zero == 3 else (lambda a, b: b * local + a)  # (inner, outer) -> index
        for i, t in enumerate(leaves):
            sums = [sum((grads[at(a, b)][i] for a in inner[1:]), grads[at(inner[0], b)][i]) for b in outer]
            t.grad = sum(sums[1:], sums[0])
        opt.step()
        losses.append(sum(loss.item() for loss in micro))
    return losses, {path: t.detach() for path, t in named_leaves(params)}


def worker() -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "gloo", timeout_s=60)
    out = {}
    with ctx.guard():
        for tied in (False, True):
            spec = llama_like(tied=tied)
            for name, dcfg in STAGES.items():
                trainer = data_parallel_trainer(spec, run.init_params(spec, seed=1), TrainConfig(BATCH, MICRO, "every"),
                                                ADAM, CPU32, dcfg, ctx.grid.dp_group)
                losses = [trainer.step(x, y).loss for x, y in batches(spec)]
                masters = dict(named_leaves(trainer.master_params()))  # collective: on the first rank only
                out[tied, name] = {"losses": losses, "masters": masters if ctx.rank == 0 else None,
                                   "segments": trainer.inner.segments if dcfg.zero == 3 else None}
                trainer.close()
    close_distributed(ctx)
    return out


def test_data_parallel_runs_untied_and_tied_heads_without_positions():
    per_rank = spawn(worker, WORLD, start_method="fork", timeout_s=120)
    for tied in (False, True):
        spec = llama_like(tied=tied)
        head = [spec.head_unit.name] + ([spec.embed_unit.name] if tied else [])
        assert per_rank[0][tied, "zero3"]["segments"][-1] == head, tied  # the head gathers its output matrix
        for name, dcfg in STAGES.items():
            ref_losses, ref_masters = reference(spec, dcfg.zero)
            for r in per_rank:
                for a, b in zip(r[tied, name]["losses"], ref_losses):
                    assert abs(a - b) <= 1e-6 * abs(b), (tied, name, r[tied, name]["losses"], ref_losses)
            masters = per_rank[0][tied, name]["masters"]
            assert set(masters) == set(ref_masters), (tied, name)
            for path, t in ref_masters.items():
                assert rel_err(masters[path], t) <= 1e-6, (tied, name, path, rel_err(masters[path], t))
