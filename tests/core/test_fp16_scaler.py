"""fp16's loss scaler itself: an overflow skips exactly its step and halves the scale, the scale grows after
good steps, survives a save, lets the health guard wait for it; the run's fp16 on CPU; across pipeline and
tensor-parallel ranks (the TP ones: ``tests/tensor_parallel/test_tp_fp16``; the trainers against
torch.amp.GradScaler: ``test_fp16``)."""
import functools
import json
import math

import pytest
import torch

from nanotrain.core import models
from nanotrain.core.models import model_spec
from nanotrain.core.optim import OffloadConfig
from nanotrain.core.train import loop
from nanotrain.core.train.resident import ResidentTrainer, ResidentWeights
from nanotrain.core.train.scaler import LossScaler, ScalerConfig
from nanotrain.checkpoint.resume import restore
from nanotrain.checkpoint.state import save_checkpoint
from nanotrain.data import DataPosition
from tests.core.test_fp16 import ADAM, CFG, TCFG, _autograd, _batches, _streamed, _trainer


def test_streamed_overflow_skips_exactly_one_step_and_saves_the_scale(tmp_path):
    """An inf in the bottom block's gradient, found after every other unit's backward: nothing applied, the
    scale halved; the scaler's state is in the checkpoint and a resumed run goes on as the whole one."""
    sc = ScalerConfig(init_scale=2.0 ** 8, growth_interval=1000)
    batches = list(_batches(4))
    trainer = _streamed(sc)
    assert not trainer.step(*batches[0]).skipped
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    final = trainer._final_block

    def poisoned(i, slot):
        if i == 0:
            trainer.block_grads[0].view(-1)[0] = math.inf
        final(i, slot)
    trainer._final_block = poisoned
    r = trainer.step(*batches[1])
    assert r.skipped and r.overflow and r.loss_scale == 2.0 ** 8
    after = trainer.state_dict()
    assert float(after["loss_scale.scale"]) == 2.0 ** 7 and int(after["skipped_steps"]) == 1
    assert all(torch.equal(after[k], v) for k, v in before.items() if not k.startswith(("loss_scale", "skipped")))
    trainer._final_block = final
    ckpt = save_checkpoint(tmp_path, trainer, DataPosition(0, 0))
    want = [trainer.step(x, y) for x, y in batches[2:]]
    assert not any(r.skipped for r in want) and trainer.opt.steps == 3
    trainer.close()
    resumed = _streamed(sc)
    restore(resumed, ckpt)
    assert (resumed.scaler.scale, resumed.opt.steps, resumed.opt.skipped_steps) == (2.0 ** 7, 1, 1)
    got = [resumed.step(x, y) for x, y in batches[2:]]
    assert [(r.loss, r.loss_scale) for r in got] == [(r.loss, r.loss_scale) for r in want]
    resumed.close()


def test_autograd_adapter_injected_overflow_skips_one_step(tmp_path):
    sc = ScalerConfig(init_scale=2.0 ** 8, growth_interval=1000)
    trainer = _autograd(sc, poison=lambda step: step == 1)
    batches = list(_batches(3))
    assert not trainer.step(*batches[0]).skipped
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    r = trainer.step(*batches[1])  # an inf weight: an inf loss, inf and NaN gradients; GradScaler would back off
    after = trainer.state_dict()
    assert r.skipped and r.loss_scale == 2.0 ** 8 and float(after["loss_scale.scale"]) == 2.0 ** 7
    assert all(torch.equal(after[k], v) for k, v in before.items() if not k.startswith("loss_scale"))
    assert not trainer.step(*batches[2]).skipped


@pytest.mark.parametrize("exact", [True, False], ids=["exact-skip", "after-backward"])
def test_injected_overflow_skips_exactly_that_step_and_halves_the_scale(exact):
    trainer = _trainer(ScalerConfig(init_scale=2.0 ** 8, growth_interval=1000), exact=exact)  # 2**16 overflows
    batches = list(_batches(3))
    assert not trainer.step(*batches[0]).skipped
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    weights = [w.clone() for w in trainer.opt.weights("blocks.0")]
    # an inf in one gradient of the unit handed over last (the embeddings): with exact skips, earlier units
    # were updated already; without, none was handed over before the finite check
    orig = trainer.weights._on_grad

    def poisoned(path, leaf):
        if path == "wpe":
            leaf.grad[0, 0] = math.inf
        orig(path, leaf)
    trainer.weights._on_grad = poisoned
    r = trainer.step(*batches[1])
    assert r.skipped and r.overflow and math.isfinite(r.loss) and r.loss_scale == 2.0 ** 8
    after = trainer.state_dict()
    for k, v in before.items():
        if k == "loss_scale.scale":
            assert float(after[k]) == float(v) / 2
        elif k == "loss_scale.good_steps":
            assert (int(v), int(after[k])) == (1, 0)
        elif k != "skipped_steps":
            assert torch.equal(after[k], v), k
    assert int(after["skipped_steps"]) == 1
    assert all(torch.equal(a, b) for a, b in zip(trainer.opt.weights("blocks.0"), weights))  # republished
    trainer.weights._on_grad = orig
    r = trainer.step(*batches[2])
    assert not r.skipped and r.loss_scale == 2.0 ** 7 and trainer.opt.steps == 2
    trainer.close()


def test_scale_grows_after_growth_interval_good_steps():
    s = LossScaler(ScalerConfig(init_scale=8.0, growth_interval=3))
    for expected in (8, 8, 16, 16, 16, 32):
        s.update(False)
        assert s.scale == expected
    s.update(True)
    assert (s.scale, s.good_steps) == (16, 0)
    trainer = _trainer(ScalerConfig(init_scale=2.0 ** 8, growth_interval=2))
    scales = [trainer.step(x, y).loss_scale for x, y in _batches(5)]
    assert scales == [2.0 ** 8, 2.0 ** 8, 2.0 ** 9, 2.0 ** 9, 2.0 ** 10]
    trainer.close()


def test_scale_survives_save_and_resume(tmp_path):
    sc = ScalerConfig(init_scale=2.0 ** 8, growth_interval=3)
    batches = list(_batches(6))
    whole = _trainer(sc)
    want = [whole.step(x, y) for x, y in batches]
    whole.close()
    first = _trainer(sc)
    for x, y in batches[:4]:
        first.step(x, y)
    ckpt = save_checkpoint(tmp_path, first, DataPosition(0, 0))
    first.close()
    resumed = _trainer(sc)
    restore(resumed, ckpt)
    assert (resumed.scaler.scale, resumed.scaler.good_steps) == (2.0 ** 9, 1)
    got = [resumed.step(x, y) for x, y in batches[4:]]
    assert [(r.loss, r.loss_scale) for r in got] == [(r.loss, r.loss_scale) for r in want[4:]]
    resumed.close()


def test_fp16_under_an_outside_optimizer_needs_exact_skip_without_clipping():
    """One process checks the whole backward before any update; an optimizer applied from outside (data
    parallelism) hands units over as they are final, and only exact skips undo a later rank's overflow."""
    from nanotrain.core.optim import OffloadAdam
    with pytest.raises(ValueError, match="exact_skip"):
        ResidentTrainer(CFG, models.init_params(CFG, seed=1), TCFG, ADAM,
                        OffloadConfig(device="cpu", dtype=torch.float16),
                        functools.partial(ResidentWeights, make_opt=functools.partial(OffloadAdam, copy=False)))


def test_health_guard_lets_the_scaler_find_its_scale():
    """2**30 overflows for many steps in a row: backoffs are not failures, so a guard of 3 does not stop the run."""
    trainer = _trainer(ScalerConfig(init_scale=2.0 ** 30, growth_interval=1000))
    batches = _batches(20)
    lcfg = loop.LoopConfig(steps=20, sequences_per_step=4, seq_len=16, max_skipped_steps=3)
    records = loop.run(trainer, lambda: next(batches), lcfg, [], torch.device("cpu"))
    skipped = [r["skipped"] for r in records]
    assert skipped[:5] == [True] * 5 and not skipped[-1] and trainer.opt.steps == 20 - sum(skipped)
    assert records[0]["loss_scale"] == 2.0 ** 30 and records[-1]["loss_scale"] < 2.0 ** 25
    trainer.close()


def test_finetune_fp16_on_cpu_runs_resumes_streams_and_runs_data_parallel(offline_files, tmp_path, monkeypatch,
                                                                           capsys):
    from tasks.finetune import main
    from tests.conftest import SHAKESPEARE, TOKENIZER_DIR

    monkeypatch.chdir(tmp_path)
    common = ["--model", "tiny", "--batch", "4", "--micro-batch", "2", "--seq", "32", "--dtype", "fp16",
              "--data", str(SHAKESPEARE), "--tokenizer-dir", str(TOKENIZER_DIR), "--out", "run", "--lr", "1e-3"]
    main(common + ["--steps", "2"])
    main(common + ["--steps", "3", "--resume"])
    out = capsys.readouterr().out
    assert "torch.float16 compute" in out and "resumed from run/step-000002 at step 2" in out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss_scale"] > 0 for r in rows)
    main(common + ["--steps", "2", "--stream", "--clip-norm", "1.0", "--out", "run2"])
    rows = [json.loads(line) for line in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss_scale"] > 0 and "grad_norm" in r for r in rows)
    main(common + ["--steps", "2", "--dp", "2", "--zero", "2", "--clip-norm", "0.5", "--out", "run3"])
    rows = [json.loads(line) for line in (tmp_path / "run3" / "metrics.jsonl").read_text().splitlines()]
    # 2**16 overflows the first step (its norm is inf, written as null); the second is applied, clipped
    assert [(r["step"], r["skipped"], r["loss_scale"]) for r in rows] == [(1, True, 2.0 ** 16), (2, False, 2.0 ** 15)]
    assert rows[1]["grad_norm"] > 0.5 and rows[1]["clipped"]
    main(common + ["--steps", "2", "--stream", "--dp", "2", "--clip-norm", "0.5", "--out", "run4"])
    rows = [json.loads(line) for line in (tmp_path / "run4" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped"], r["loss_scale"]) for r in rows] == [(1, True, 2.0 ** 16), (2, False, 2.0 ** 15)]
    assert rows[1]["grad_norm"] > 0.5 and rows[1]["clipped"]


def test_host_plan_counts_fp16s_fp32_gradients_and_the_exact_skip_copy():
    from nanotrain.core.footprint import plan_resident_host
    from nanotrain.core.recompute import RecomputePolicy
    every, n = RecomputePolicy.parse("every"), model_spec(CFG).costs.total_params
    bf16, fp16, fp16_exact = (plan_resident_host(CFG, 1, 16, every, 32, True, True, fp16=f, exact_skip=e).total
                              for f, e in ((False, False), (True, False), (True, True)))
    assert fp16 - bf16 == 2 * n  # gradients at 4 bytes, not 2
    assert fp16_exact - fp16 == (4 + 8) * n  # exact skips: masters and 32-bit moments again


def _pipeline_scaler_worker():
    """In one world: a scaled pipeline (a power-of-two scale: exact in fp32) against the same one unscaled,
    and one whose scale overflows the loss: every rank skips that step, nothing applied, the scale halved."""
    from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size
    from nanotrain.pipeline import LayeredModel, build_pipeline, build_schedule
    from tasks.demos.adapters import PipelineTrainer
    from tests.core.test_clip_ranks import PCFG, _data

    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(pp=launched_world_size()), "gloo", timeout_s=60)
    out = {}
    with ctx.guard():
        for name, scale in (("plain", None), ("scaled", 2.0 ** 10), ("overflow", 2.0 ** 127)):
            pipe = build_pipeline(ctx, LayeredModel.from_spec(PCFG, 16), build_schedule("1f1b", ctx.world_size, 4, 1),
                                  _data()[0][0][:2], seed=0)
            scaler = None if scale is None else LossScaler(ScalerConfig(init_scale=scale, growth_interval=1000))
            trainer = PipelineTrainer(pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-3), 4, clip_norm=0.5,
                                      scaler=scaler)
            before = {p: t.detach().clone() for p, t in pipe.named_parameters()}
            results = [trainer.step(x, y) for x, y in _data()[:1 if name == "overflow" else 2]]
            after = {p: t.detach().clone() for p, t in pipe.named_parameters()}
            out[name] = ([(r.loss, r.skipped, r.loss_scale, r.grad_norm) for r in results], after,
                         all(torch.equal(before[p], after[p]) for p in before))
    close_distributed(ctx)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_pipeline_loss_scaling_is_exact_and_skips_on_every_rank(world):
    from nanotrain.distributed import spawn

    for out in spawn(_pipeline_scaler_worker, world, timeout_s=120, start_method="fork"):
        plain, scaled = out["plain"], out["scaled"]
        assert [r[0] for r in plain[0]] == [r[0] for r in scaled[0]] and not any(r[1] for r in scaled[0])
        assert [r[3] for r in plain[0]] == [r[3] for r in scaled[0]]
        assert all(torch.equal(plain[1][p], scaled[1][p]) for p in plain[1])
        (loss, skipped, scale, _), = out["overflow"][0]
        assert skipped and scale == 2.0 ** 127 and out["overflow"][2]  # nothing applied
