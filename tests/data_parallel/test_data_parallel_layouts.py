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
Every loss, every gradient norm (``torch.nn.utils.clip_grad_norm_``'s where clipped), the validation loss after the
last step (ZeRO-3's gathered unit by unit, the head with its output matrix) and every master within 1e-6 relative
(norm-wise per tensor). One forked world per size runs every check.

AdamW runs with eps = 1e-2, the references too: a rounding delta of a gradient then moves an update by at most
lr |delta| / eps (the slope of g / (|g| + eps)), so the gradients' fp32 agreement carries over to the weights (measured:
within 1.5e-7 after 3 steps). With torch's 1e-8, an element whose gradient is near eps turns its rounding (the
all-reduce's own order, ZeRO-3's reduce-scatter) into up to lr: 3 elements of Qwen3's 15360-element embedding moved
by 1e-3 lr, 1.2e-6 of its norm, which bounds nothing. Past eps the update follows the gradient's size, so a gradient
off by a factor is off by that factor in the weights (Adam's sign-like step would hide it).
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
from tests.conftest import rel_err
from tests.data_parallel.test_data_parallel import ADAM as ADAM_1E8, CPU32
from tests.core.test_trainer import LLAMA, QWEN2, QWEN3, TIED_LLAMA

BATCH, MICRO, STEPS = 12, 2, 3
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
        x = torch.randint(0, model_spec(cfg).vocab_size, (BATCH, 16), generator=g)
        y = x.roll(-1, dims=1)
        y[:, -3:] = -100
        y[1, :7] = -100  # ranks see different target counts
        out.append((x, y))
    return out


def reference(cfg, zero: int, world: int, clip: float | None) -> tuple[list[float], list[float], Tree]:
    """Autograd per micro-batch, the gradients summed in ``zero``'s order on ``world`` ranks, clipped by torch,
    torch's AdamW: the losses, the norms where clipped, the masters."""
    spec = model_spec(cfg)
    params = run.init_params(spec, seed=1)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    opt = torch.optim.AdamW(leaves, lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps, weight_decay=ADAM.weight_decay,
                            foreach=False)
    local = BATCH // world // MICRO  # micro-batches per rank: micro-batch j of rank r is r * local + j
    inner, outer = (range(world), range(local)) if zero == 3 else (range(local), range(world))
    losses, norms = [], []
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
        opt.step()
        losses.append(sum(loss.item() for loss in micro))
    return losses, norms, tree_map(torch.Tensor.detach, params)


def streamed_reference(cfg, clip: float | None) -> tuple[list[float], list[float], Tree]:
    """One process streaming the whole batch."""
    trainer = StreamTrainer(cfg, run.init_params(model_spec(cfg), seed=1), replace(SCFG, clip_norm=clip), ADAM, CPU32)
    results = [trainer.step(x, y) for x, y in batches(cfg)]
    masters = trainer.master_params()
    trainer.close()
    return [r.loss for r in results], [r.grad_norm for r in results if r.clipped], masters


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
                results = [trainer.step(x, y) for x, y in batches(cfg)]
                masters = trainer.master_params()  # collective: on the first rank only
                out[model, name] = {"losses": [r.loss for r in results], "eval": trainer.eval_loss(*batches(cfg)[0]),
                                    "norms": [r.grad_norm for r in results if r.clipped],
                                    "masters": masters if ctx.rank == 0 else None,
                                    "segments": trainer.inner.weights.segments if dcfg and dcfg.zero == 3 else None}
                trainer.close()
    close_distributed(ctx)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_runs_the_llama_class_untied_tied_biased_and_normalised(world):
    per_rank = spawn(worker, world, start_method="fork", timeout_s=120)
    for model, cfg in MODELS.items():
        spec = model_spec(cfg)
        head = [spec.head_unit.name] + ([spec.embed_unit.name] if spec.head_weight in spec.embed_unit.paths else [])
        assert per_rank[0][model, "zero3"]["segments"][-1] == head, model  # the head gathers its output matrix
        for name, (dcfg, clip) in RUNS.items():
            ref_losses, ref_norms, ref_masters = (streamed_reference(cfg, clip) if dcfg is None else
                                                  reference(cfg, dcfg.zero, world, clip))
            assert len(ref_norms) == (STEPS if clip else 0), (model, name)
            with torch.no_grad():
                ref_eval = run.loss(spec, ref_masters, *batches(cfg)[0]).item()
            for r in per_rank:
                ours = r[model, name]["losses"] + r[model, name]["norms"] + [r[model, name]["eval"]]
                for a, b in zip(ours, ref_losses + ref_norms + [ref_eval], strict=True):
                    assert abs(a - b) <= 1e-6 * abs(b), (model, name, ours, ref_losses, ref_norms)
            masters = per_rank[0][model, name]["masters"]
            assert [p for p, _ in named_leaves(masters)] == [p for p, _ in named_leaves(ref_masters)], (model, name)
            for (path, a), (_, b) in zip(named_leaves(masters), named_leaves(ref_masters)):
                assert rel_err(a, b) <= 1e-6, (model, name, path, rel_err(a, b))
