"""Layer-by-layer weight streaming against the plain path (fp32, the CPU as the device: copies instead
of transfers). The GPU check, bf16 against the non-streaming trainer, is ``tasks.bench.stream_check``."""
import pytest
import torch

from nanotrain.core import models
from nanotrain.core.models import model_spec, preset, run
from nanotrain.core.optim import OffloadConfig
from nanotrain.stream.pinned import HostArena
from nanotrain.stream.trainer import StreamConfig, StreamTrainer
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.core.tree import get_path, named_leaves
from tests.conftest import (adam_bounds, adam_cap, assert_codes_moved, assert_norms, chain_rtol, model_chain, moved_by,
                            rel_err, unclipped_apart)
from tests.core.test_trainer import (ADAM, CFG, CPU32, LLAMA, QWEN2, QWEN3, TIED_LLAMA, _batches, _reference,
                                applied_grads, assert_adam_run)


@pytest.mark.parametrize("on_host,tail", [(0, 0), (2, 0), (1, 1), (0, 3)])
def test_streaming_equals_autograd_and_torch_adamw(monkeypatch, on_host, tail):
    """Same losses and updated weights as plain autograd + torch.optim.AdamW, block inputs on the
    device or in host memory, the top blocks layer-major or in a tail (up to the whole model).
    Every gradient enters an update, so matching weights after 4 steps checks them all; the test
    below checks the first step's gradients directly."""
    from nanotrain.stream.optimizer import StreamedAdam
    ref_params, ref_losses, _ = _reference(4, grads=(ref_grads := []))
    grads, real = [], StreamedAdam.update  # each step's gradients, as each unit's update got them

    def spy(self, slot, unit_grads):
        grads[-1].update({path: g.clone() for path, g in zip(slot.unit.paths, unit_grads)})
        real(self, slot, unit_grads)

    monkeypatch.setattr(StreamedAdam, "update", spy)
    scfg = StreamConfig(batch=8, micro_batch=2, on_host=on_host, tail=tail)
    trainer = StreamTrainer(CFG, models.init_params(CFG, seed=1), scfg, ADAM, CPU32)
    losses = [(grads.append({}), trainer.step(x, y).loss)[1] for x, y in _batches(4)]
    assert_adam_run(trainer.master_params(), ref_params, (losses, grads), (ref_losses, ref_grads))
    assert trainer.opt.steps == 4
    trainer.close()


@pytest.mark.parametrize("model,tail,tail_mb", [(CFG, 0, None), (CFG, 2, 1), (LLAMA, 0, None), (LLAMA, 2, 1),
                                               (TIED_LLAMA, 1, None), (QWEN2, 1, 1), (QWEN3, 1, None)],
                         ids=["gpt2", "gpt2-tail", "llama", "llama-tail", "tied-llama-tail", "qwen2-tail",
                              "qwen3-tail"])
def test_streaming_gradients_equal_the_plain_ones(monkeypatch, model, tail, tail_mb):
    """Each unit's fp32 gradient, as handed to the update, against the full-batch autograd gradient,
    also with a tail run in passes of one sequence, and on the Llama class (``tiny-llama``: no position table,
    grouped-query attention, the head untied or tied; Qwen2's biases, Qwen3's per-head norms). (Its weights after
    several steps are not compared with the reference's: passes of another size sum the gradient in another order,
    and Adam turns rounding in near-zero gradients into lr-sized steps.)"""
    from nanotrain.stream.optimizer import StreamedAdam
    x, y = next(_batches(1, vocab=model_spec(model).vocab_size))
    full = models.init_params(model, seed=1)
    [t.requires_grad_() for _, t in named_leaves(full)]
    models.loss(full, x, y, model).backward()
    seen = {}
    real = StreamedAdam.update

    def spy(self, slot, grads):
        for path, g in zip(slot.unit.paths, grads):
            seen[path] = g.clone()
        real(self, slot, grads)

    monkeypatch.setattr(StreamedAdam, "update", spy)
    scfg = StreamConfig(batch=8, micro_batch=2, tail=tail, tail_micro_batch=tail_mb)
    trainer = StreamTrainer(model, models.init_params(model, seed=1), scfg, ADAM, CPU32)
    trainer.step(x, y)
    assert sorted(seen) == sorted(p for p, _ in named_leaves(full))
    rtol = chain_rtol(model_chain(model, x.shape[1], x.numel()))  # passes of other sizes: any sum's order
    for path, t in named_leaves(full):
        assert rel_err(seen[path], t.grad) <= rtol, path
    trainer.close()


GPT2_DROPOUT = preset("tiny", n_layer=3, vocab_size=512, resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1)


LLAMA_DROPOUT = preset("tiny-llama", n_layer=3, attention_dropout=0.1)


@pytest.mark.parametrize("cfg,bits,clip", [(GPT2_DROPOUT, 32, None), (GPT2_DROPOUT, 8, None), (LLAMA_DROPOUT, 32, None),
                                           (LLAMA_DROPOUT, 8, None), (LLAMA, 32, 0.05)],
                         ids=["gpt2-32", "gpt2-8", "llama-32", "llama-8", "llama-clip"])
def test_streaming_equals_the_non_streaming_trainer(monkeypatch, cfg, bits, clip):
    """With dropout (masks replayed from seeds) and 8-bit moments: the same steps as ``ResidentTrainer``; also
    on the Llama class (``tiny-llama``: untied head, no position table, attention dropout) and with clipping (both
    trainers' deferred paths). fp32 moments: each weight within what AdamW makes of the gradients each trainer
    applied, each loss within the chain's bound plus what that moves it (``test_trainer.assert_adam_run``), the norms
    within those gradients' distance (``conftest.assert_norms``)."""
    ocfg = OffloadConfig(device="cpu", dtype=torch.float32, state_bits=bits, min_8bit_numel=1024,
                         keep_32bit=model_spec(cfg).fp32_moments)
    plain = ResidentTrainer(cfg, models.init_params(cfg, seed=1),
                            TrainConfig(batch=8, micro_batch=4, recompute="every", clip_norm=clip), ADAM, ocfg)
    streamed = StreamTrainer(cfg, models.init_params(cfg, seed=1),
                             StreamConfig(batch=8, micro_batch=4, on_host=1, tail=1, clip_norm=clip), ADAM, ocfg)
    applied = {"plain": applied_grads(monkeypatch, "resident"), "streamed": applied_grads(monkeypatch, "streamed")}
    results, before = [], []  # each step's results; the masters each started from (streamed, plain), copied
    for x, y in _batches(3, vocab=model_spec(cfg).vocab_size):
        [grads.append({}) for grads in applied.values()]
        before.append([{p: t.clone() for p, t in named_leaves(t.master_params())} for t in (streamed, plain)])
        results.append((plain.step(x, y), streamed.step(x, y)))
    plain.opt.synchronize()
    mine, theirs = streamed.opt.state_dict(), plain.opt.state_dict()
    assert sorted(mine) == sorted(theirs)  # checkpoints of either trainer resume the other
    assert clip is None or all(a.clipped and b.clipped for a, b in results)
    if bits == 32:
        ref, ours = zip(*results)  # the plain trainer's steps, the streamed one's
        assert_adam_run(streamed.master_params(), plain.master_params(), ([r.loss for r in ours], applied["streamed"]),
                        ([r.loss for r in ref], applied["plain"]), model=cfg)
        if clip is not None:
            norms, ref_norms = [r.grad_norm for r in ours], [r.grad_norm for r in ref]
            apart = unclipped_apart(applied["streamed"], applied["plain"], norms, ref_norms, clip)
            sizes = [g.numel() for g in applied["plain"][0].values()]
            assert_norms(norms, ref_norms, apart, chain_rtol(model_chain(cfg, 16, 8 * 16)), sizes)
    else:  # 8-bit moments (see below): each loss within the chain's bound plus what the masters it came from,
        # measured apart, move it (conftest.moved_by; the plain trainer's gradient there is its applied one, unclipped)
        loss_rtol = chain_rtol(model_chain(cfg, 16, 8 * 16, "loss"))
        for (a, b), (mine_w, ref_w), g in zip(results, before, applied["plain"], strict=True):
            assert abs(b.loss - a.loss) <= loss_rtol * a.loss + moved_by(g, mine_w, ref_w), (a.loss, b.loss)
        # the same blocks on both sides, but a rounding-level difference in a gradient (the two trainers sum the
        # tied embedding's two contributions in another order) can move a moment across a code boundary
        start = before[0][1]
        aparts, _ = adam_bounds(start, applied["streamed"], applied["plain"], ADAM)
        for path, apart in aparts.items():
            assert_codes_moved(get_path(streamed.master_params(), path), get_path(plain.master_params(), path),
                               apart[-1], adam_cap(start[path], len(results), ADAM), path)
    plain.close()
    streamed.close()


def test_nan_loss_skips_the_step_before_any_update(monkeypatch):
    trainer = StreamTrainer(CFG, models.init_params(CFG, seed=1),
                            StreamConfig(batch=8, micro_batch=4, on_host=1, tail=1),
                            ADAM, CPU32)
    x, y = next(_batches(1))
    trainer.step(x, y)
    before = {p: t.clone() for p, t in named_leaves(trainer.master_params())}
    real = run.head_loss
    monkeypatch.setattr(run, "head_loss", lambda *a, **k: real(*a, **k) * float("nan"))
    result = trainer.step(x, y)
    assert result.skipped and trainer.opt.skipped_steps == 1 and trainer.opt.steps == 1
    for path, t in named_leaves(trainer.master_params()):
        assert torch.equal(t, before[path]), path
    monkeypatch.setattr(run, "head_loss", real)
    assert not trainer.step(x, y).skipped and trainer.opt.steps == 2
    trainer.close()


def test_loading_a_state_replaces_what_the_device_slots_hold():
    """Units keep their masters and moments in their device slots between steps (no reload); a loaded
    state must replace them: the two steps after rewinding repeat the two steps after saving."""
    trainer = StreamTrainer(CFG, models.init_params(CFG, seed=1), StreamConfig(batch=8, micro_batch=4, tail=1), ADAM,
                            CPU32)
    batches = list(_batches(4))
    for x, y in batches[:2]:
        trainer.step(x, y)
    saved = {k: v.clone() for k, v in trainer.opt.state_dict().items()}
    first = [trainer.step(x, y).loss for x, y in batches[2:]]
    trainer.opt.load_state_dict(saved)
    assert [trainer.step(x, y).loss for x, y in batches[2:]] == first
    trainer.close()


def test_the_loaded_tree_is_consumed_not_copied():
    params = models.init_params(CFG, seed=1)
    trainer = StreamTrainer(CFG, params, StreamConfig(batch=8, micro_batch=4), ADAM, CPU32)
    assert all(t is None for _, t in named_leaves(params))
    assert torch.equal(get_path(trainer.master_params(), "wte"), models.init_params(CFG, seed=1)["wte"])
    trainer.close()


def test_bad_configurations_are_named():
    with pytest.raises(ValueError, match="batch 8 is not divisible by micro-batch 3"):
        StreamConfig(batch=8, micro_batch=3)
    with pytest.raises(ValueError, match="on_host=9: the model keeps only 3 block inputs"):
        StreamTrainer(CFG, models.init_params(CFG, seed=1), StreamConfig(batch=8, micro_batch=4, on_host=9), ADAM,
                      CPU32)
    with pytest.raises(ValueError, match=r"on_host=3: the model keeps only 2 block inputs \(3 blocks, 1 of them in"):
        StreamTrainer(CFG, models.init_params(CFG, seed=1), StreamConfig(8, 4, on_host=3, tail=1), ADAM, CPU32)
    with pytest.raises(ValueError, match="tail micro-batch 3 must divide the micro-batch 4"):
        StreamConfig(batch=8, micro_batch=4, tail=1, tail_micro_batch=3)
    dropout = preset("tiny", n_layer=2, resid_pdrop=0.1)
    with pytest.raises(ValueError, match="with dropout the tail runs whole micro-batches"):
        StreamTrainer(dropout, models.init_params(dropout), StreamConfig(8, 4, tail=1, tail_micro_batch=2), ADAM, CPU32)


def test_arena_carves_aligned_views_and_refuses_overflow():
    arena = HostArena(HostArena.size_of([(3, torch.uint8), (5, torch.float32)]), pin=False)
    a, b = arena.take(3, torch.uint8), arena.take(5, torch.float32)
    assert a.numel() == 3 and b.numel() == 5 and b.data_ptr() % 64 == 0
    with pytest.raises(ValueError, match="cannot hold 1 more"):
        arena.take(1, torch.uint8)

