"""ZeRO-3 on the layouts of Llama-class models: a head with an output matrix of its own (untied), and a tied
head without a position table. ZeRO-3 is the one engine here that runs the forward through ``run_units``
itself: it must gather the head's output matrix with the head, wherever the spec keeps it.

Two CPU ranks against plain autograd + ``torch.optim.AdamW`` on the whole batch (fp32), the micro-batches'
gradients summed in ZeRO-3's order: each local micro-batch's sum over the ranks (a reduce-scatter), then
those sums in turn. Same terms, same order: every loss within 1e-6 relative and every master within 1e-6
relative (norm-wise), the key bias aside (``tests.test_data_parallel.assert_state_matches`` says why).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from nanotrain.data_parallel import DPConfig, data_parallel_trainer
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from nanotrain.models import model_spec, preset, run
from nanotrain.models.spec import VOCAB, Leaf, ModelSpec, Placement, Unit
from nanotrain.train.resident import TrainConfig
from nanotrain.tree import named_leaves
from tests.test_data_parallel import ADAM, CPU32, MICRO, assert_state_matches

CFG = preset("tiny", n_layer=3, vocab_size=512)
BATCH, WORLD, STEPS = 8, 2, 3


def llama_layout(tied: bool) -> ModelSpec:
    """The test model's spec without its position table and, unless ``tied``, with an output matrix in the
    head unit: the two layouts of Llama-class families (Llama 3.2 1B ties its head, Llama 3 8B does not)."""
    base = model_spec(CFG)
    token, = (leaf for leaf in base.leaves if leaf.path == base.head_weight)
    leaves = [leaf for leaf in base.leaves if leaf.path not in base.embed_unit.paths or leaf is token]
    head = base.head_unit.paths
    if not tied:
        leaves.append(Leaf("output", token.shape, "normal", Placement(0, ((VOCAB, 1),))))
        head += ("output",)

    def embed(params, tokens, ops, seed):  # no dropout in this model
        return ops.embed(tokens, params[token.path])

    units = (replace(base.embed_unit, paths=(token.path,)), *base.block_units, Unit(base.head_unit.name, head, "head"))
    return replace(base, leaves=tuple(leaves), units=units, embed=embed, tied=base.tied if tied else (),
                   fp32_moments=(token.path,), head_weight=token.path if tied else "output")


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


def reference(spec: ModelSpec) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Autograd per micro-batch, the gradients summed as ZeRO-3 sums them on ``WORLD`` ranks, torch's AdamW."""
    params = run.init_params(spec, seed=1)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    opt = torch.optim.AdamW(leaves, lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps, weight_decay=ADAM.weight_decay,
                            foreach=False)
    local = BATCH // WORLD // MICRO  # micro-batches per rank: micro-batch j of rank r is r * local + j
    losses = []
    for x, y in batches(spec):
        denom = int((y != -100).sum())
        micro = [run.loss(spec, params, xm, ym, denom=denom) for xm, ym in zip(x.split(MICRO), y.split(MICRO))]
        grads = [torch.autograd.grad(loss, leaves) for loss in micro]
        for i, t in enumerate(leaves):
            sums = [sum((grads[r * local + j][i] for r in range(1, WORLD)), grads[j][i]) for j in range(local)]
            t.grad = sum(sums[1:], sums[0])
        opt.step()
        losses.append(sum(loss.item() for loss in micro))
    return losses, {f"master.{path}": t.detach() for path, t in named_leaves(params)}


def worker() -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "gloo", timeout_s=60)
    out = {}
    with ctx.guard():
        for tied in (True, False):
            spec = llama_layout(tied)
            trainer = data_parallel_trainer(spec, run.init_params(spec, seed=1), TrainConfig(BATCH, MICRO, "every"),
                                            ADAM, CPU32, DPConfig(zero=3), ctx.grid.dp_group)
            losses = [trainer.step(x, y).loss for x, y in batches(spec)]
            state = trainer.state_dict()
            out[tied] = {"losses": losses, "segments": trainer.inner.segments,
                         "masters": {k: t.clone() for k, t in state.items() if k.startswith("master.")}}
            trainer.close()
    close_distributed(ctx)
    return out


def test_zero3_runs_untied_heads_and_models_without_positions():
    per_rank = spawn(worker, WORLD, start_method="fork", timeout_s=120)
    for tied in (True, False):
        spec = llama_layout(tied)
        ref_losses, ref_masters = reference(spec)
        head = [spec.head_unit.name] + ([spec.embed_unit.name] if tied else [])
        for r in per_rank:
            assert r[tied]["segments"][-1] == head and r[tied]["segments"][0] == [spec.embed_unit.name], tied
            for a, b in zip(r[tied]["losses"], ref_losses):
                assert abs(a - b) <= 1e-6 * abs(b), (tied, r[tied]["losses"], ref_losses)
        assert_state_matches(per_rank[0][tied]["masters"], ref_masters, f"tied={tied}")
