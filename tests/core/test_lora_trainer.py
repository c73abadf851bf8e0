"""The resident trainer on an adapted spec against autograd + torch.optim.AdamW over the adapters alone (fp32, CPU
as the device): the base frozen (no gradient, no optimizer state, unchanged), the pairs trained by the same AdamW.

Bounds as ``test_trainer``'s (``assert_adam_run``): from the gradients each side applied, each pair within what AdamW
makes of them, each loss within the chain's bound (the pairs' rank counted) plus what that distance moves it.
"""
import pytest
import torch

from nanotrain.core.models import model_spec, preset, run
from nanotrain.core.models.lora import LoraConfig, with_lora
from nanotrain.core.optim import OffloadConfig
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.core.tree import get_path, named_leaves
from tests.conftest import adam_bounds, chain_rtol, model_chain, rel_err
from tests.core.test_trainer import ADAM, CPU32, applied_grads, assert_adam_run

SPECS = {"gpt2": with_lora(model_spec(preset("tiny", n_layer=2, vocab_size=256)), LoraConfig(4, 8.0, ("qkv", "down"))),
         "llama": with_lora(model_spec(preset("tiny-llama")), LoraConfig(4, 8.0, ("q", "v", "o", "gate", "down")))}


def batches(spec, n, batch=8, seq=16):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        x = torch.randint(0, spec.vocab_size, (batch, seq), generator=g)
        y = x.roll(-1, dims=1)
        y[:, -3:] = -100
        yield x, y


def reference(spec, steps, micro_batch=2, grads=None):
    """Autograd over the same micro-batches, torch's AdamW over the pairs: the parameters, each step's loss; each
    step's gradients of the pairs by path appended to ``grads``."""
    params = run.init_params(spec, seed=1)
    trained = [t.requires_grad_() for p, t in named_leaves(params) if spec.leaf(p).trainable]
    opt = torch.optim.AdamW(trained, lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps, weight_decay=ADAM.weight_decay,
                            foreach=False)
    losses = []
    for x, y in batches(spec, steps):
        opt.zero_grad()
        denom, total = int((y != -100).sum()), 0.0
        for xm, ym in zip(x.split(micro_batch), y.split(micro_batch)):
            loss = run.loss(spec, params, xm, ym, denom=denom)
            loss.backward()
            total += loss.item()
        if grads is not None:
            grads.append({p: t.grad.clone() for p, t in named_leaves(params) if t.grad is not None})
        opt.step()
        losses.append(total)
    return params, losses


def assert_eval_after(trainer, spec, ref_params, aparts: dict) -> None:
    """Validation after the last step (evaluation reads the frozen base and the trained pairs): the chain's bound
    plus what the pairs' distance (``aparts``, from ``assert_adam_run``) moves it: its gradient at the reference's
    weights times that distance, to first order."""
    x, y = next(batches(spec, 1))
    want = run.loss(spec, ref_params, x, y)
    trained = list(aparts)
    moved = sum(float((g.double().abs().reshape(-1) * aparts[p][-1]).sum())
                for p, g in zip(trained, torch.autograd.grad(want, [get_path(ref_params, p) for p in trained])))
    bound = chain_rtol(model_chain(spec, 16, x.numel(), "loss")) * want.item() + moved
    assert abs(trainer.eval_loss(x, y) - want.item()) <= bound


@pytest.mark.parametrize("recompute", ["none", "every", "lean"])
@pytest.mark.parametrize("name", SPECS)
def test_adapters_train_as_autograd_and_adamw_and_the_base_stays(monkeypatch, name, recompute):
    spec = SPECS[name]
    ref_params, ref_losses = reference(spec, 3, grads=(ref_grads := []))
    trainer = ResidentTrainer(spec, run.init_params(spec, seed=1), TrainConfig(batch=8, micro_batch=2,
                                                                               recompute=recompute), ADAM, CPU32)
    grads = applied_grads(monkeypatch, "resident")  # each step's, as each unit's update got them
    losses = [(grads.append({}), trainer.step(x, y).loss)[1] for x, y in batches(spec, 3)]
    trainer.opt.synchronize()
    state = trainer.state_dict()
    trained = [leaf.path for leaf in spec.leaves if leaf.trainable]
    assert {k.removeprefix("master.") for k in state if k.startswith("master.")} == set(trained)
    aparts = assert_adam_run(trainer.master_params(), ref_params, (losses, grads), (ref_losses, ref_grads), model=spec)
    assert sorted(aparts) == sorted(trained)
    fresh = run.init_params(spec, seed=1)
    for path, t in trainer.weights.frozen.store.items():
        assert torch.equal(t, get_path(fresh, path)), path  # the base is as it came
    assert_eval_after(trainer, spec, ref_params, aparts)
    trainer.close()


@pytest.mark.parametrize("recompute", ["none", "every", "selective", "lean"])
def test_qlora_trains_on_the_dequantised_base(recompute):
    """``base_bits=4``: the blocks' frozen matrices in NF4, dequantised at each matmul (and again for its backward),
    against autograd over the same base dequantised once: the same fp32 weights, the sums in other orders (the
    hand-written backward's), so the first gradients within the chain's bound, and each loss within the chain's
    bound plus what the pairs' distance, from the gradients each side applied, moves it (``conftest.adam_bounds``)."""
    from nanotrain.core.frozen import quantized
    from nanotrain.core.nf4 import NF4Tensor, dequantize_nf4, quantize_nf4

    spec = SPECS["llama"]
    g = torch.Generator().manual_seed(5)  # B drawn non-zero, so that A's gradient is checked at the first step
    fresh = [(p, torch.randn(t.shape, generator=g) * 0.1 if p.endswith("_b") and spec.leaf(p).trainable else t)
             for p, t in named_leaves(run.init_params(spec, seed=1))]
    base = [(p, dequantize_nf4(quantize_nf4(t), torch.float32) if quantized(spec, p) else t.clone()) for p, t in fresh]
    ref_params = run.tree_from(spec, base)
    trained = [t.requires_grad_() for p, t in named_leaves(ref_params) if spec.leaf(p).trainable]
    opt = torch.optim.AdamW(trained, lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps, weight_decay=ADAM.weight_decay,
                            foreach=False)
    start = {p: t.clone() for p, t in fresh if spec.leaf(p).trainable}  # the pairs both begin from
    trainer = ResidentTrainer(spec, run.tree_from(spec, fresh), TrainConfig(batch=8, micro_batch=8,
                              recompute=recompute), ADAM, OffloadConfig(device="cpu", dtype=torch.float32, base_bits=4))
    assert isinstance(trainer.weights.frozen.store["blocks.0.qkv_w"], NF4Tensor)
    losses, ref_losses, grads, ref_grads = [], [], [], []  # each side's, each step (the gradients as AdamW got them)
    for x, y in batches(spec, 3):
        opt.zero_grad()
        loss = run.loss(spec, ref_params, x, y)
        loss.backward()
        ref_grads.append({p: t.grad.clone() for p, t in named_leaves(ref_params) if spec.leaf(p).trainable})
        opt.step()
        ref_losses.append(loss.item())
        losses.append(trainer.step(x, y).loss)
        grads.append({p: trainer.weights.accum[p].clone() for p in ref_grads[-1]})
    grad_rtol = chain_rtol(model_chain(spec, 16, 8 * 16))
    for p, g in ref_grads[0].items():  # from the same weights
        assert rel_err(grads[0][p], g) <= grad_rtol, p
    moved = adam_bounds(start, grads, ref_grads, ADAM)[1]
    loss_rtol = chain_rtol(model_chain(spec, 16, 8 * 16, "loss"))
    for s, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= loss_rtol * b + moved[s], (s, a, b)
    trainer.close()
