"""fp16 with dynamic loss scaling: the resident and streamed trainers against torch.amp.GradScaler + AdamW.

CPU fp16 matmuls work (slowly): the model is tiny. Both sides compute the forward and backward with the
same fp16 weights (the fp32 masters rounded to fp16) through the same model functions, accumulate the
micro-batches' gradients in fp32 and unscale them in fp32, so the gradients agree bit for bit while the
weights do; what differs is the AdamW arithmetic (ours vs torch's, ~1e-7 relative on fp32 masters), and once a
master sits on the other side of an fp16 rounding boundary, every later forward: the masters within what fp16
gradients' roundings let the steps move (``assert_masters_moved``).
"""
import math
from dataclasses import replace

import pytest
import torch

from nanotrain.core import models
from nanotrain.core.models import model_spec, preset
from nanotrain.core.optim import AdamConfig, OffloadConfig
from tasks.demos.adapters import AutogradTrainer
from nanotrain.core.train.resident import HandOver, ResidentTrainer, TrainConfig
from nanotrain.core.train.clip import clip_
from nanotrain.core.train.scaler import LossScaler, ScalerConfig
from nanotrain.stream.trainer import StreamConfig, StreamTrainer
from nanotrain.core.tree import get_path, named_leaves, tree_map
from tests.conftest import adam_cap, chain_rtol

CFG = preset("tiny", n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_ctx=16)
LLAMA = preset("tiny-llama", vocab_size=64)  # 6 query heads over 2 key/value heads, an MLP 100 wide, untied
ADAM = AdamConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CPU16 = OffloadConfig(device="cpu", dtype=torch.float16, offload=True, exact_skip=True)
TCFG = TrainConfig(batch=4, micro_batch=2, recompute="every")


def _batches(n, batch=4, seq=16):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        x = torch.randint(0, CFG.vocab_size, (batch, seq), generator=g)
        yield x, x.roll(-1, dims=1)


def _trainer(scaler=None, tcfg=TCFG, exact=True, cfg=CFG):
    t = ResidentTrainer(cfg, models.init_params(cfg, seed=1), tcfg, ADAM, replace(CPU16, exact_skip=exact))
    if scaler is not None:
        t.scaler = LossScaler(scaler)
    return t


def _reference(steps, scaler_cfg: ScalerConfig, micro_batch=2, clip=None, batch=4, cfg=CFG, torch_clip=True):
    """fp32 masters in torch's AdamW, an fp16 copy to compute with, GradScaler to scale and unscale, torch's
    ``clip_grad_norm_`` (or with ``torch_clip=False`` the library's ``train.clip``) to clip to ``clip``."""
    masters = models.init_params(cfg, seed=1)
    leaves = [t for _, t in named_leaves(masters)]
    opt = torch.optim.AdamW(leaves, lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps, weight_decay=ADAM.weight_decay,
                            foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=scaler_cfg.init_scale, growth_interval=scaler_cfg.growth_interval)
    losses, scales = [], []
    for x, y in _batches(steps, batch):
        half = tree_map(lambda t: t.detach().half().requires_grad_(), masters)
        for m in leaves:
            m.grad = torch.zeros_like(m)
        denom, loss = int((y != -100).sum()), 0.0
        for xm, ym in zip(x.split(micro_batch), y.split(micro_batch)):
            micro = models.loss(half, xm, ym, cfg, denom=denom)
            scaler.scale(micro).backward()
            loss += micro.item()
            for (_, h), m in zip(named_leaves(half), leaves):
                m.grad += h.grad.float()  # fp32 accumulation, as the trainer's buffers
                h.grad = None
        scaler.unscale_(opt)
        if clip is not None:
            if torch_clip:
                torch.nn.utils.clip_grad_norm_(leaves, clip)
            else:
                clip_([m.grad for m in leaves], clip)
        scales.append(scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        losses.append(loss)
    return masters, losses, scales


def _steps_at_own_weights(trainer, steps: int, cfg=CFG, micro_batch: int = 2) -> list:
    """``steps`` of ``_batches`` on ``trainer``, each step's loss checked against the reference's at the trainer's
    own masters of that step (their fp16 copies through the same model functions: each micro-batch's loss bit for
    bit, the trainer summing them in fp32 where the reference sums in float64: one run of an n-term sum's rounding,
    ``chain_rtol``). That the masters follow the reference's is the weights' bound's: so do the losses then."""
    results = []
    for x, y in _batches(steps):
        want = loss_at(trainer.master_params(), x, y, cfg, micro_batch)
        results.append(trainer.step(x, y))
        rtol = chain_rtol([len(x) // micro_batch], runs=1)
        assert abs(results[-1].loss - want) <= rtol * want, (len(results), want)
    return results


def loss_at(masters, x, y, cfg=CFG, micro_batch: int = 2) -> float:
    """The reference's loss of a batch at ``masters`` (its fp16 copies, micro-batch by micro-batch, summed in
    float64)."""
    half = tree_map(lambda t: t.detach().half(), masters)
    denom = int((y != -100).sum())
    with torch.no_grad():
        return sum(models.loss(half, xm, ym, cfg, denom=denom).item()
                   for xm, ym in zip(x.split(micro_batch), y.split(micro_batch)))


@pytest.mark.parametrize("exact", [True, False], ids=["exact-skip", "after-backward"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_fp16_equals_gradscaler_and_torch_adamw(clip, exact):
    # init scale 2**20 overflows the first steps (backed off, skipped on both sides), interval 3 grows it
    sc = ScalerConfig(init_scale=2.0 ** 20, growth_interval=3)
    ref, _, ref_scales = _reference(12, sc, clip=clip)
    trainer = _trainer(sc, TrainConfig(batch=4, micro_batch=2, recompute="every", clip_norm=clip), exact)
    # with clipping and exact skips: speculative, redone
    assert (trainer.weights.hand_over is not HandOver.HELD) == exact
    results = _steps_at_own_weights(trainer, 12)
    assert [r.loss_scale for r in results] == ref_scales
    assert any(r.skipped for r in results) and not all(r.skipped for r in results)
    assert all(r.overflow == r.skipped for r in results)
    assert_masters_moved(trainer.master_params(), ref, sum(not r.skipped for r in results))
    trainer.close()


def _streamed(scaler: ScalerConfig, clip=None, tail=0, cfg=CFG):
    scfg = StreamConfig(batch=4, micro_batch=2, clip_norm=clip, tail=tail)
    t = StreamTrainer(cfg, models.init_params(cfg, seed=1), scfg, ADAM,
                      OffloadConfig(device="cpu", dtype=torch.float16))
    t.scaler = LossScaler(scaler)
    return t


@pytest.mark.parametrize("clip,tail", [(None, 0), (0.5, 1)])
def test_streamed_fp16_equals_gradscaler_and_torch_adamw(clip, tail):
    """The same scales and skips, step for step. The streamed step sums the tied embedding's two gradients (LM
    head, embedding) in fp32 and each block's weight gradient comes from its recompute, where autograd sums in fp16:
    the masters within what those fp16 roundings let the steps move (``assert_masters_moved``; measured <= 2.1% of
    lr)."""
    sc = ScalerConfig(init_scale=2.0 ** 20, growth_interval=3)
    ref, _, ref_scales = _reference(12, sc, clip=clip)
    trainer = _streamed(sc, clip, tail)
    results = _steps_at_own_weights(trainer, 12)
    assert [r.loss_scale for r in results] == ref_scales
    assert any(r.skipped for r in results) and all(r.overflow == r.skipped for r in results)
    assert trainer.opt.skipped_steps == sum(r.skipped for r in results)
    assert_masters_moved(trainer.master_params(), ref, sum(not r.skipped for r in results))
    trainer.close()


FP16_BULK = 8 * 2.0 ** -11  # of lr per applied step (tests/data_parallel/test_data_parallel_clip_fp16.py derives it)
FP16_RARE = 0.25            # the largest share of a leaf's elements that may move beyond it


def assert_masters_moved(ours, ref, applied: int, cfg=CFG) -> None:
    """An fp16 run's masters against the reference's after ``applied`` steps of ``ADAM`` from the same weights, as
    the data-parallel fp16 test derives it: each element's fp16 gradient carries about eight roundings of 2^-11, which
    Adam's step of about lr turns into ``FP16_BULK`` lr per applied step; where a gradient is near zero the same
    rounding can flip its sign, for at most ``FP16_RARE`` of a leaf; none beyond what any gradients can move
    (``conftest.adam_cap``; |w| throughout within twice the reference's plus 2 lr a step). GPT-2's key bias, whose
    true gradient is 0 (softmax ignores it: its rounding noise moved by whole steps), by that cap alone. A lost or
    unclipped update moves most of a leaf by about lr."""
    heads, kv_heads, d = model_spec(cfg).heads
    for path, t in named_leaves(ref):
        a, b = get_path(ours, path), t.detach()
        cap = adam_cap(2 * b.abs() + 2 * ADAM.lr * applied, applied, ADAM)
        assert ((a - b).abs() <= cap).all(), (path, ((a - b).abs() / cap).max())
        moved = (a - b).abs() / ADAM.lr
        if path.endswith("qkv_b"):
            moved = torch.cat([moved[:heads * d], moved[(heads + kv_heads) * d:]])  # all but the keys'
        assert (moved > applied * FP16_BULK).float().mean() <= FP16_RARE, (path, moved.quantile(0.75))


@pytest.mark.parametrize("kind", ["resident-exact-skip", "resident-after-backward", "streamed-tail"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_llama_fp16_equals_gradscaler_and_torch_adamw(kind, clip):
    """The Llama class (``tiny-llama``: grouped-query attention, an MLP 100 wide, an untied head) in fp16, resident
    and streamed: the scales and skips step for step, each loss that of its own masters (``_steps_at_own_weights``),
    the masters within what the steps can move (``assert_masters_moved``; measured: one element of the embedding's
    3072 beyond the bulk, 3% of lr, with clipping after the backward)."""
    sc = ScalerConfig(init_scale=2.0 ** 20, growth_interval=3)
    ref, _, ref_scales = _reference(12, sc, clip=clip, cfg=LLAMA)
    if kind == "streamed-tail":
        trainer = _streamed(sc, clip, tail=1, cfg=LLAMA)
    else:
        tcfg = TrainConfig(batch=4, micro_batch=2, recompute="every", clip_norm=clip)
        trainer = _trainer(sc, tcfg, exact=kind.endswith("exact-skip"), cfg=LLAMA)
    results = _steps_at_own_weights(trainer, 12, LLAMA)
    assert [r.loss_scale for r in results] == ref_scales
    assert any(r.skipped for r in results) and all(r.overflow == r.skipped for r in results)
    assert_masters_moved(trainer.master_params(), ref, sum(not r.skipped for r in results), LLAMA)
    trainer.close()


def _autograd(scaler: ScalerConfig, clip=None, poison=None):
    """The autograd adapter with fp32 leaves computing in fp16 (a cast in the loss: fp16 gradients come back
    as fp32, as the reference's ``h.grad.float()``); ``poison(step)``: put an inf into the loss's input."""
    params = models.init_params(CFG, seed=1)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    opt = torch.optim.AdamW(leaves, lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps, weight_decay=ADAM.weight_decay,
                            foreach=False)

    def loss_fn(x, y):
        half = tree_map(lambda t: t.half(), params)
        if poison is not None and poison(trainer.step_count):
            half["wpe"] = half["wpe"] * torch.tensor([math.inf] + [1.0] * (CFG.n_ctx - 1), dtype=torch.half)[:, None]
        return models.loss(half, x, y, CFG)

    trainer = AutogradTrainer(params, loss_fn, opt, CFG, clip_norm=clip, scaler=LossScaler(scaler))
    return trainer


@pytest.mark.parametrize("clip", [None, 0.5])
def test_autograd_adapter_fp16_equals_gradscaler(clip):
    """The pipeline's and tensor parallelism's adapter: the same steps as GradScaler + AdamW, bit for bit. Where it
    clips, the reference clips as the adapter does (``train.clip``): torch's ``clip_grad_norm_`` sums the norm in
    another order, and the factor's last-bit difference would move a master across an fp16 rounding boundary now
    and then, which every later forward sees. That the library's clipping is torch's, to the bound of those
    orders, is ``tests/core/test_clip.py``'s (the adapter's too); here only the scaling, the unscaling and the
    skips are in question, and with the same clipping they change no bit."""
    sc = ScalerConfig(init_scale=2.0 ** 20, growth_interval=3)
    ref, ref_losses, ref_scales = _reference(12, sc, micro_batch=4, clip=clip, torch_clip=False)
    trainer = _autograd(sc, clip)
    results = [trainer.step(x, y) for x, y in _batches(12)]
    assert [r.loss_scale for r in results] == ref_scales
    assert any(r.overflow for r in results) and all(r.overflow == r.skipped for r in results)
    assert [r.loss for r in results] == ref_losses
    for path, t in named_leaves(ref):
        assert torch.equal(get_path(trainer.params, path).detach(), t), path
