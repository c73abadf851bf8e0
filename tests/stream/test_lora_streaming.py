"""The streamed trainer on an adapted spec (the frozen base travelling with each unit, the pairs' masters and
moments streamed as every unit's are) against autograd + torch.optim.AdamW over the adapters alone (fp32, the CPU as
the device). The bounds of ``test_streaming`` (``test_trainer.assert_adam_run``): from the gradients each side applied,
each pair within what AdamW makes of them, each loss within the chain's bound (the pairs' rank counted) plus what
that distance moves it."""
import pytest
import torch

from nanotrain.core.models import run
from nanotrain.core.tree import named_leaves
from nanotrain.stream.trainer import StreamConfig, StreamTrainer
from tests.conftest import assert_norms, chain_rtol, model_chain, unclipped_apart
from tests.core.test_lora_trainer import ADAM, CPU32, SPECS, assert_eval_after, batches, reference
from tests.core.test_trainer import applied_grads, assert_adam_run


@pytest.mark.parametrize("name,on_host,tail,compile", [(name, on_host, tail, False) for name in SPECS
                                                       for on_host, tail in ((0, 0), (1, 1), (0, 2))]
                         + [("llama", 0, 1, True)])
def test_streamed_adapters_equal_autograd_and_adamw(monkeypatch, name, on_host, tail, compile):
    """``compile``: the blocks compiled, their backward's recompute too (a block with pairs recomputes whole; one
    case: inductor takes ~30 s a spec on the CPU)."""
    spec = SPECS[name]
    ref_params, ref_losses = reference(spec, 3, grads=(ref_grads := []))
    trainer = StreamTrainer(spec, run.init_params(spec, seed=1),
                            StreamConfig(batch=8, micro_batch=2, on_host=on_host, tail=tail, compile=compile), ADAM,
                            CPU32)
    grads = applied_grads(monkeypatch, "streamed")  # each step's, as each unit's update got them
    losses = [(grads.append({}), trainer.step(x, y).loss)[1] for x, y in batches(spec, 3)]
    masters = trainer.master_params()
    trained = [leaf.path for leaf in spec.leaves if leaf.trainable]
    assert {k.removeprefix("master.") for k in trainer.state_dict() if k.startswith("master.")} == set(trained)
    aparts = assert_adam_run(masters, ref_params, (losses, grads), (ref_losses, ref_grads), model=spec)
    assert sorted(aparts) == sorted(trained)
    assert_eval_after(trainer, spec, ref_params, aparts)  # validation after the last step
    trainer.close()


def test_a_streamed_lora_checkpoint_resumes_on_the_resident_trainer():
    """The same optimizer keys (the pairs' masters and moments) in either engine: the next step's loss, of the same
    weights, within the chain's bound."""
    from nanotrain.core.train.resident import ResidentTrainer, TrainConfig

    spec = SPECS["llama"]
    streamed = StreamTrainer(spec, run.init_params(spec, seed=1), StreamConfig(batch=8, micro_batch=2), ADAM, CPU32)
    resident = ResidentTrainer(spec, run.init_params(spec, seed=1), TrainConfig(batch=8, micro_batch=2), ADAM, CPU32)
    first, second = list(batches(spec, 2))
    streamed.step(*first)
    resident.load_state_dict(streamed.state_dict())
    want = streamed.step(*second).loss
    assert abs(resident.step(*second).loss - want) <= chain_rtol(model_chain(spec, 16, 8 * 16, "loss")) * want
    streamed.close()
    resident.close()


def test_a_clipped_streamed_lora_step_equals_torch_clipping(monkeypatch):
    """The deferred step (``stream.deferred``) over the pairs alone: the frozen embedding and head have no update.
    From the clipped gradients each side applied, the pairs and losses as above (``test_trainer.assert_adam_run``),
    each norm within those gradients' distance unclipped (``conftest.assert_norms``)."""
    spec, clip = SPECS["llama"], 0.05
    params = run.init_params(spec, seed=1)
    trained = [t.requires_grad_() for p, t in named_leaves(params) if spec.leaf(p).trainable]
    opt = torch.optim.AdamW(trained, lr=ADAM.lr, betas=ADAM.betas, eps=ADAM.eps, weight_decay=ADAM.weight_decay,
                            foreach=False)
    trainer = StreamTrainer(spec, run.init_params(spec, seed=1),
                            StreamConfig(batch=8, micro_batch=8, clip_norm=clip), ADAM, CPU32)
    grads, ours, ref = applied_grads(monkeypatch, "streamed"), [], []  # (loss, norm) each step, each side
    ref_grads = []
    for x, y in batches(spec, 3):
        opt.zero_grad()
        loss = run.loss(spec, params, x, y)
        loss.backward()
        ref.append((loss.item(), torch.nn.utils.clip_grad_norm_(trained, clip).item()))
        ref_grads.append({p: t.grad.clone() for p, t in named_leaves(params) if t.grad is not None})
        opt.step()
        result = (grads.append({}), trainer.step(x, y))[1]
        assert result.clipped
        ours.append((result.loss, result.grad_norm))
    (losses, norms), (ref_losses, ref_norms) = zip(*ours), zip(*ref)
    aparts = assert_adam_run(trainer.master_params(), params, (list(losses), grads), (list(ref_losses), ref_grads),
                             model=spec)
    assert sorted(aparts) == sorted(p for p, _ in named_leaves(params) if spec.leaf(p).trainable)  # every pair
    apart = unclipped_apart(grads, ref_grads, list(norms), list(ref_norms), clip)
    sizes = [g.numel() for g in ref_grads[0].values()]
    assert_norms(list(norms), list(ref_norms), apart, chain_rtol(model_chain(spec, 16, 8 * 16)), sizes)
    trainer.close()


@pytest.mark.parametrize("tail", [0, 1])
def test_streamed_qlora_equals_the_resident_one(monkeypatch, tail):
    """``base_bits=4`` streamed (the NF4 codes and scales travel, each matrix dequantised at its matmul) against the
    resident trainer's QLoRA (``test_lora_trainer``), which holds the same codes: the same products in fp32, the
    recompute's input gradients summed as the resident ``every`` policy sums them: from the gradients each trainer
    applied, the pairs and losses as above (``test_trainer.assert_adam_run``)."""
    from nanotrain.core.optim import OffloadConfig
    from nanotrain.core.train.resident import ResidentTrainer, TrainConfig

    spec = SPECS["gpt2"]
    ocfg = OffloadConfig(device="cpu", dtype=torch.float32, base_bits=4)
    resident = ResidentTrainer(spec, run.init_params(spec, seed=1), TrainConfig(batch=8, micro_batch=2,
                                                                                recompute="every"), ADAM, ocfg)
    streamed = StreamTrainer(spec, run.init_params(spec, seed=1), StreamConfig(batch=8, micro_batch=2, tail=tail),
                             ADAM, ocfg)
    applied = {"resident": applied_grads(monkeypatch, "resident"), "streamed": applied_grads(monkeypatch, "streamed")}
    losses = {"resident": [], "streamed": []}
    for x, y in batches(spec, 3):
        for kind, trainer in (("resident", resident), ("streamed", streamed)):
            applied[kind].append({})
            losses[kind].append(trainer.step(x, y).loss)
    resident.opt.synchronize()
    aparts = assert_adam_run(streamed.master_params(), resident.master_params(),
                             (losses["streamed"], applied["streamed"]), (losses["resident"], applied["resident"]),
                             model=spec)
    assert sorted(aparts) == sorted(leaf.path for leaf in spec.leaves if leaf.trainable)  # every pair
    streamed.close()
    resident.close()
