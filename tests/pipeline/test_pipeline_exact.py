"""Every schedule on 2 and 4 CPU processes reproduces single-process training exactly (fp32).

GPT-2 (tied embedding and head on the first and last rank) under all four schedules against the
model's own ``loss`` on the whole batch, the Llama class on 2 ranks (``tiny-llama``: 6 query heads over 2
key/value heads, an MLP 100 wide, an untied head) cut between attention and MLP sublayers, and Qwen2 (q/k/v
biases, its embedding tied to the head on the first and last rank) in whole blocks, and a CNN from
``tasks.demos.cifar`` as any sequential
model: the first loss and every gradient within ``conftest.chain_rtol`` of the reductions they come out of
(``bounds``), three AdamW steps' losses within that plus what the updates move them (``check``). The CNN's
reference accumulates the same micro-batches in one process: oneDNN convolutions sum in a different order for a
batch of 8 than of 2, and through eight layers that alone moves the first layer's gradient by 1.3e-6 relative,
pipeline or not.
Workers are forked so that CI's two cores are not spent importing torch once per process.
"""
from __future__ import annotations

import pytest
import torch

from nanotrain.distributed import (GridConfig, close_distributed, init_distributed, launched_world_size,
                                   spawn)
from tasks.demos.cifar import cnn_loss, make_cnn_layers
from nanotrain.core.models import preset
from nanotrain.core.models import init_params, loss as lm_loss
from nanotrain.core.optim import AdamConfig
from nanotrain.pipeline import LayeredModel, StageSpec, build_pipeline, build_schedule, train_step
from tasks.demos.pipeline_sequential import sequential_layered
from nanotrain.pipeline.build import materialize
from nanotrain.core.tree import named_leaves
from tests.conftest import adam_bounds, chain_rtol, model_chain, rel_err

CFG = preset("tiny", n_layer=8, n_embd=32, n_head=4, n_ctx=16, vocab_size=256)
LLAMA = preset("tiny-llama", n_layer=4)  # grouped-query attention, rotary positions, SwiGLU, an untied head
QWEN2 = preset("tiny-llama", n_layer=4, architecture="qwen2", tie_word_embeddings=True)
MICRO, MB_SIZE, SEQ, STEPS, LR = 4, 2, 16, 3, 1e-2
ADAM = AdamConfig(lr=LR, weight_decay=0.01)  # torch.optim.AdamW's, as both sides run it
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)]
CNN_SCHEDULES = [("1f1b", 1), ("zb-h1", 1)]


def gpt2_data() -> tuple[torch.Tensor, torch.Tensor]:
    """[steps, micro-batches, micro-batch size, seq] tokens and targets, some targets ignored."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (STEPS, MICRO, MB_SIZE, SEQ), generator=gen)
    targets = torch.randint(0, CFG.vocab_size, (STEPS, MICRO, MB_SIZE, SEQ), generator=gen)
    targets[..., :3] = -100
    return tokens, targets


def cnn_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(STEPS, MICRO, MB_SIZE, 3, 32, 32, generator=gen),
            torch.randint(0, 10, (STEPS, MICRO, MB_SIZE), generator=gen))


def cnn_model():
    return sequential_layered(make_cnn_layers(width=4, hidden=16), cnn_loss)


def single_process(params, loss_fn, data) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """The whole batch at once in one process: each step's loss and gradients."""
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    opt = torch.optim.AdamW(leaves, lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(params, data[0][step], data[1][step])  # [micro-batches, micro-batch, ...]
        loss.backward()
        grads.append({path: t.grad.clone() for path, t in named_leaves(params)})
        losses.append(loss.item())
        opt.step()
    return losses, grads


def pipelined(ctx, model, data, schedules) -> dict:
    results = {}
    for name, virtual in schedules:
        pipe = build_pipeline(ctx, model, build_schedule(name, ctx.world_size, MICRO, virtual), data[0][0, 0], seed=0)
        opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
        start = {path: t.detach().clone() for path, t in pipe.named_parameters()}
        losses, grads = [], []  # each step's, as AdamW applied them
        for s in range(STEPS):
            losses.append(float(train_step(pipe, opt, data[0][s], data[1][s])))
            grads.append({path: t.grad.clone() for path, t in pipe.named_parameters()})
        results[name] = (losses, grads, start)
    return results


def worker() -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(pp=launched_world_size()), "gloo", timeout_s=60)
    with ctx.guard():
        results = {"gpt2": pipelined(ctx, LayeredModel.from_spec(CFG, SEQ), gpt2_data(), SCHEDULES)}
        if ctx.world_size == 4:  # attention and MLP as separate layers, stages cut between them
            results["gpt2 sublayers"] = pipelined(ctx, LayeredModel.from_spec(CFG, SEQ, sublayers=True), gpt2_data(),
                                                  SCHEDULES)
        if ctx.world_size == 2:
            results["cnn"] = pipelined(ctx, cnn_model(), cnn_data(), CNN_SCHEDULES)
            results["llama sublayers"] = pipelined(ctx, LayeredModel.from_spec(LLAMA, SEQ, sublayers=True), gpt2_data(),
                                                   SCHEDULES)
            results["qwen2 tied"] = pipelined(ctx, LayeredModel.from_spec(QWEN2, SEQ), gpt2_data(), SCHEDULES)
    close_distributed(ctx)
    return results


@pytest.fixture(scope="module")
def references() -> dict:
    torch.set_num_threads(1)
    gpt2 = single_process(init_params(CFG, seed=0), lambda p, x, y: lm_loss(p, x.flatten(0, 1), y.flatten(0, 1), CFG),
                          gpt2_data())
    model = cnn_model()
    whole = StageSpec(0, 1, model.first, model.layers, model.head)

    def accumulated(p, x, y):
        return sum(whole.forward(p, x[k], y[k], model.denominator(y)) for k in range(MICRO))

    cnn = single_process(materialize(model, set(model.shapes), 0, torch.device("cpu"), torch.float32),
                         accumulated, cnn_data())
    llama = single_process(init_params(LLAMA, seed=0),
                           lambda p, x, y: lm_loss(p, x.flatten(0, 1), y.flatten(0, 1), LLAMA), gpt2_data())
    qwen2 = single_process(init_params(QWEN2, seed=0),
                           lambda p, x, y: lm_loss(p, x.flatten(0, 1), y.flatten(0, 1), QWEN2), gpt2_data())
    return {"gpt2": gpt2, "cnn": cnn, "llama": llama, "qwen2": qwen2}


def bounds(name: str) -> tuple[float, float]:
    """The first loss's and the gradients' bounds (``conftest.chain_rtol``): a language model's chain over the whole
    batch; the CNN's reference sums the same micro-batches, so only the sum over the micro-batches reorders (in
    fp32) and each layer's kernels see the same shapes (oneDNN's convolutions sum a batch of 8 in another order
    than of 2: through eight layers that alone moves the first layer's gradient by 1.3e-6)."""
    cfg = {"gpt2": CFG, "llama": LLAMA, "qwen2": QWEN2}.get(name.split()[0])
    if cfg is None:
        return chain_rtol([MICRO]), chain_rtol([MICRO])
    tokens = MICRO * MB_SIZE * SEQ
    return chain_rtol(model_chain(cfg, SEQ, tokens, "loss")), chain_rtol(model_chain(cfg, SEQ, tokens))


def check(name: str, per_rank: list[tuple], ref: tuple[list[float], list[dict[str, torch.Tensor]]]) -> None:
    """Each rank's losses and first gradients against one process's; the later losses within the first's bound plus
    what the updates move them, AdamW of the gradients each side applied (``conftest.adam_bounds`` of each stage's
    leaves, summed over the ranks: a tied copy counted twice, an upper bound)."""
    ref_losses, ref_grads = ref
    seen, (loss_rtol, grad_rtol) = set(), bounds(name)
    moved = [sum(m) for m in zip(*(adam_bounds(start, grads, [{p: g[p] for p in start} for g in ref_grads], ADAM)[1]
                                   for _, grads, start in per_rank))]
    for rank, (losses, grads, _) in enumerate(per_rank):
        for s in range(STEPS):
            bound = loss_rtol * abs(ref_losses[s]) + moved[s]
            assert abs(losses[s] - ref_losses[s]) <= bound, (name, rank, s, losses, ref_losses)
        for path, g in grads[0].items():  # both copies of a tied parameter must carry the full gradient
            err = rel_err(g, ref_grads[0][path])
            assert err <= grad_rtol, f"{name}, rank {rank}: gradient of {path} off by {err:.2e}"
            seen.add(path)
    assert seen == set(ref_grads[0]), f"{name}: parameters on no rank: {set(ref_grads[0]) - seen}"


@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_matches_single_process(world, references):
    per_rank = spawn(worker, world, timeout_s=240, start_method="fork")
    runs = (("gpt2", "gpt2", SCHEDULES), ("gpt2 sublayers", "gpt2", SCHEDULES if world == 4 else []),
            ("cnn", "cnn", CNN_SCHEDULES if world == 2 else []),
            ("llama sublayers", "llama", SCHEDULES if world == 2 else []),
            ("qwen2 tied", "qwen2", SCHEDULES if world == 2 else []))
    for model, reference, schedules in runs:
        for name, _ in schedules:
            check(f"{model} {name} on {world} ranks", [r[model][name] for r in per_rank], references[reference])
