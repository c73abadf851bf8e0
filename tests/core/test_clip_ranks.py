"""Gradient clipping by global norm across ranks, against autograd + torch.nn.utils.clip_grad_norm_ +
torch.optim.AdamW on one process: the pipeline (the norm summed over its stages), tensor parallelism (replicated
parameters counted once)."""
import pytest
import torch

from nanotrain.core import models
from nanotrain.core.models import preset
from nanotrain.core.optim import AdamConfig
from nanotrain.core.tree import get_path, named_leaves
from nanotrain.distributed import (GridConfig, close_distributed, init_distributed, launched_world_size, run_in_group,
                                   spawn)
from nanotrain.pipeline import LayeredModel, build_pipeline, build_schedule
from tasks.demos.adapters import AutogradTrainer, PipelineTrainer
from tests.conftest import adam_bounds, assert_norms, chain_rtol, model_chain, unclipped_apart

PCFG = preset("tiny", n_layer=4, n_embd=32, n_head=4, n_ctx=16, vocab_size=256)
PIPE_NORM = 0.5


def _data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (8, 16), generator=g), torch.randint(0, 256, (8, 16), generator=g))
            for _ in range(3)]


def _pipeline_worker():
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(pp=launched_world_size()), "gloo", timeout_s=60)
    with ctx.guard():
        pipe = build_pipeline(ctx, LayeredModel.from_spec(PCFG, 16), build_schedule("1f1b", ctx.world_size, 4, 1),
                              _data()[0][0][:2], seed=0)
        trainer = PipelineTrainer(pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-3), 4, clip_norm=PIPE_NORM)
        results, grads = [], []  # each step's clipped gradients, as AdamW applied them
        for x, y in _data():
            results.append(trainer.step(x, y))
            grads.append({path: t.grad.clone() for path, t in pipe.named_parameters()})
        params = {path: t.detach().clone() for path, t in pipe.named_parameters()}
    close_distributed(ctx)
    times = [(r.forward_s, r.backward_s, r.optimizer_s, r.copy_wait_s) for r in results]  # monitor.steptime
    return [(r.loss, r.grad_norm, r.clipped) for r in results], params, times, grads


def test_pipeline_clips_by_the_norm_of_the_whole_model():
    per_rank = spawn(_pipeline_worker, 2, timeout_s=120, start_method="fork")
    params = models.init_params(PCFG, seed=0)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    opt = torch.optim.AdamW(leaves, lr=1e-3)
    start, want, ref_grads = {p: t.detach().clone() for p, t in named_leaves(params)}, [], []
    for x, y in _data():
        opt.zero_grad()
        loss = models.loss(params, x, y, PCFG)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(leaves, PIPE_NORM).item()
        ref_grads.append({path: t.grad.clone() for path, t in named_leaves(params)})
        opt.step()
        want.append((loss.item(), norm, norm > PIPE_NORM))
    assert any(c for _, _, c in want)
    loss_rtol, grad_rtol = (chain_rtol(model_chain(PCFG, 16, 8 * 16, what)) for what in ("loss", "grads"))
    hp = AdamConfig(lr=1e-3, weight_decay=0.01)  # torch.optim.AdamW's defaults
    # each weight within what AdamW makes of the clipped gradients each side applied, each loss within the chain's
    # bound plus what that moves it over both ranks' stages (conftest.adam_bounds); the norms within the distance of
    # the unclipped gradients each side applied (conftest.assert_norms; a tied copy is the same on both stages)
    bounds = [adam_bounds({p: start[p] for p in got}, grads, ref_grads, hp) for _, got, _, grads in per_rank]
    moved = [sum(m[s] for _, m in bounds) for s in range(len(want))]
    merged = [{k: v for _, _, _, grads in per_rank for k, v in grads[s].items()} for s in range(len(want))]
    for (results, got, times, _), (aparts, _) in zip(per_rank, bounds):
        assert all(t > 0 for step in times for t in step)  # the split: forward, backward, optimizer, waits
        for s, ((loss, norm, clipped), (wl, wn, wc)) in enumerate(zip(results, want)):
            assert abs(loss - wl) <= loss_rtol * wl + moved[s] and clipped == wc, (s, loss, wl)
        norms, ref_norms = [norm for _, norm, _ in results], [wn for _, wn, _ in want]
        apart = unclipped_apart(merged, ref_grads, norms, ref_norms, PIPE_NORM)
        assert_norms(norms, ref_norms, apart, grad_rtol, [t.numel() for t in start.values()], ranks=2)
        for path, t in got.items():
            over = ((t - get_path(params, path).detach()).abs().reshape(-1) / aparts[path][-1]).max()
            assert over <= 1, f"{path}: {over:.2f} times its bound"


TCFG = preset("tiny", n_layer=2, n_embd=48, n_head=6, vocab_size=251, n_ctx=32)  # uneven heads, padded vocabulary
TP_NORM = 0.5
U = 2.0 ** -24  # fp32's unit roundoff
GRAD_RTOL = 160 * U  # ~1e-5, derived in test_tensor_parallel_clips_by_the_norm_of_the_whole_model
STEP_TOL = 8 * U     # per element, in units of |p| + lr: the rounding of one fp32 AdamW update


def _tp_worker(rank, world):
    """Each rank checks its shards against the single-process step in float64, clipped by torch, sharded the
    same way: the norm and the clipped gradients, then each weight against float64 AdamW from the same start
    and this rank's clipped gradient."""
    from nanotrain.distributed import GridConfig as TPGrid, build_grid
    from nanotrain.tensor_parallel import grad_norm, parallel_loss, plan_tp, shard_params, sync_grads
    from nanotrain.core.tree import tree_map
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 251, (4, 16), generator=g), torch.randint(0, 251, (4, 16), generator=g)
    full = tree_map(torch.Tensor.double, models.init_params(TCFG, seed=0))
    leaves = [t.requires_grad_() for _, t in named_leaves(full)]
    models.loss(full, x, y, TCFG).backward()
    norm = torch.nn.utils.clip_grad_norm_(leaves, TP_NORM).item()
    grid = build_grid(TPGrid(tp=world))
    out = {"norm": norm}
    for sp in (False, True):
        plan = plan_tp(TCFG, grid, sequence_parallel=sp)
        local = tree_map(lambda t: t.requires_grad_(), shard_params(models.init_params(TCFG, seed=0), plan))
        trainer = AutogradTrainer(local, lambda a, b: parallel_loss(local, a, b, plan),
                                  torch.optim.AdamW([t for _, t in named_leaves(local)]),
                                  after_backward=lambda: sync_grads(local, plan), clip_norm=TP_NORM,
                                  norm_fn=lambda: grad_norm(local, plan))
        result = trainer.step(x, y)
        want = dict(named_leaves(shard_params(tree_map(lambda t: t.grad, full), plan)))
        start = named_leaves(shard_params(tree_map(torch.Tensor.double, models.init_params(TCFG, seed=0)), plan))
        grad_err, step_err = 0.0, 0.0
        for (path, t), (_, p0) in zip(named_leaves(local), start):
            grad_err = max(grad_err, ((t.grad.double() - want[path]).norm() / want[path].norm()).item())
            p1 = p0.clone().requires_grad_()
            p1.grad = t.grad.double()
            torch.optim.AdamW([p1]).step()  # lr 1e-3, as the trainer's
            step_err = max(step_err, ((t.detach() - p1.detach()).abs() / (p0.abs() + 1e-3)).max().item())
        out[sp] = (result.grad_norm, result.clipped, grad_err, step_err)
    return out


def test_tensor_parallel_clips_by_the_norm_of_the_whole_model():
    """The bounds, from the computation rather than one machine's kernels.

    Gradients and norm (``GRAD_RTOL``, against float64): each gradient element comes out of a chain of about ten
    fp32 reductions (forward and backward through two blocks and the head), none longer than 256 terms (vocabulary
    251, MLP 192, batch x sequence 64). A reduction of n terms rounds to ~sqrt(n) u in norm (u = 2^-24, errors of
    either sign), so at most 16 u; ten of them added up: 160 u, about 1e-5, whatever order a CPU's kernels or thread
    count sum in (measured: 3.9e-7 on an AMD EPYC, 4.5e-7 on a Xeon with AVX-512). The norm is within it too, as
    |‖a‖ - ‖b‖| ≤ ‖a - b‖. A clip factor 1% off, or a shard that missed a reduction, is 1e-2 and more.

    Weights (``STEP_TOL``): AdamW is elementwise, so against float64 AdamW from the same start and this rank's
    clipped gradient, all that differs is fp32's rounding of one update: 3 u of |p| (the decay factor, its product,
    the final add) and about 8 u of the update, at most lr (the moments 3 u, the denominator's sqrt, division and
    eps 3 u, the step's division and product 2 u): 8 u (|p| + lr) (measured: 4.5 u and 5.0 u). A lost update is off
    by lr, 1e5 times the bound. (Against the reference's weights instead, the first Adam step lr g / (|g| + eps)
    would turn a rounding of the gradient in an element with |g| near eps into up to 2 lr, a sign flip: the check of
    the gradients above is where summation order belongs.)
    """
    for out in spawn(run_in_group, 2, ("gloo", _tp_worker), timeout_s=120, start_method="fork"):
        assert out["norm"] > TP_NORM
        for sp in (False, True):
            norm, clipped, grad_err, step_err = out[sp]
            assert norm == pytest.approx(out["norm"], rel=GRAD_RTOL) and clipped, sp
            assert grad_err <= GRAD_RTOL, (sp, grad_err)
            assert step_err <= STEP_TOL, (sp, step_err / U)
