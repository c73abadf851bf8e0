"""The resident trainer on an adapted spec against autograd + torch.optim.AdamW over the adapters alone (fp32, CPU
as the device): the base frozen (no gradient, no optimizer state, unchanged), the pairs trained by the same AdamW.

Bound 1e-6: the trainer sums the same micro-batches' gradients in the same order as the reference and runs the
AdamW of ``test_trainer`` (which holds to 1e-6 for the same reason); the adapters' path adds no other reduction.
"""
import pytest
import torch

from nanotrain.core.models import model_spec, preset, run
from nanotrain.core.models.lora import LoraConfig, with_lora
from nanotrain.core.optim import OffloadConfig
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.core.tree import get_path, named_leaves
from tests.conftest import rel_err
from tests.core.test_trainer import ADAM, CPU32  # assert_adam_run's AdamW

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


@pytest.mark.parametrize("recompute", ["none", "every", "lean"])
@pytest.mark.parametrize("name", SPECS)
def test_adapters_train_as_autograd_and_adamw_and_the_base_stays(name, recompute):
    spec = SPECS[name]
    ref_params, ref_losses = reference(spec, 3)
    trainer = ResidentTrainer(spec, run.init_params(spec, seed=1), TrainConfig(batch=8, micro_batch=2,
                                                                               recompute=recompute), ADAM, CPU32)
    losses = [trainer.step(x, y).loss for x, y in batches(spec, 3)]
    trainer.opt.synchronize()
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-6 * abs(b)
    state = trainer.state_dict()
    trained = [leaf.path for leaf in spec.leaves if leaf.trainable]
    assert {k.removeprefix("master.") for k in state if k.startswith("master.")} == set(trained)
    masters = trainer.master_params()
    for path in trained:
        assert rel_err(get_path(masters, path), get_path(ref_params, path).detach()) <= 1e-6, path
    fresh = run.init_params(spec, seed=1)
    for path, t in trainer.weights.frozen.store.items():
        assert torch.equal(t, get_path(fresh, path)), path  # the base is as it came
    # evaluation reads the frozen base and the trained pairs
    x, y = next(batches(spec, 1))
    assert abs(trainer.eval_loss(x, y) - run.loss(spec, ref_params, x, y).item()) <= 1e-6 * losses[0]
    trainer.close()


@pytest.mark.parametrize("recompute", ["none", "every", "selective", "lean"])
def test_qlora_trains_on_the_dequantised_base(recompute):
    """``base_bits=4``: the blocks' frozen matrices in NF4, dequantised at each matmul (and again for its backward),
    against autograd over the same base dequantised once: the same fp32 products, the input gradient's summed in
    another order by the hand-written backward (~1e-7), so losses and gradients within 1e-6. (Not the weights after
    several steps: Adam turns that rounding in near-zero gradient entries into lr-sized steps, ``test_trainer``.)"""
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
    trainer = ResidentTrainer(spec, run.tree_from(spec, fresh), TrainConfig(batch=8, micro_batch=8,
                              recompute=recompute), ADAM, OffloadConfig(device="cpu", dtype=torch.float32, base_bits=4))
    assert isinstance(trainer.weights.frozen.store["blocks.0.qkv_w"], NF4Tensor)
    for step, (x, y) in enumerate(batches(spec, 3)):
        opt.zero_grad()
        loss = run.loss(spec, ref_params, x, y)
        loss.backward()
        opt.step()
        assert abs(trainer.step(x, y).loss - loss.item()) <= 1e-6 * loss.item()
        for p, t in named_leaves(ref_params):
            if spec.leaf(p).trainable and step == 0:  # later steps start from weights Adam moved apart (above)
                assert rel_err(trainer.weights.accum[p], t.grad) <= 1e-6, (step, p)
    trainer.close()
