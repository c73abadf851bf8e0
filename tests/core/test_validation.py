"""Validation: every trainer's ``eval_loss`` equals the model's loss without dropout on its current
weights (GPT-2, and the Llama class: ``tiny-llama`` with attention dropout), evaluating leaves training untouched,
and the eval hook runs on schedule through the loop."""
import json

import pytest
import torch

from nanotrain.core import models
from nanotrain.core.models import model_spec, preset
from nanotrain.core.optim import AdamConfig
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from nanotrain.pipeline import LayeredModel, build_pipeline, build_schedule
from nanotrain.core.train import loop
from tasks.demos.adapters import AutogradTrainer, PipelineTrainer
from nanotrain.data import TokenData
from nanotrain.core.train.evaluate import Evaluator
from nanotrain.core.train.loop import LoopConfig
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.stream.trainer import StreamConfig, StreamTrainer
from nanotrain.core.tree import named_leaves
from tests.conftest import SHAKESPEARE, TOKENIZER_DIR, U32, adam_bounds, chain_rtol, model_chain
from tests.core.test_trainer import ADAM, CPU32, _batches

DROP = preset("tiny", n_layer=3, vocab_size=512, embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1)
LLAMA_DROP = preset("tiny-llama", attention_dropout=0.1)


def make(kind, cfg=DROP):
    params = models.init_params(cfg, seed=1)
    if kind == "resident":
        return ResidentTrainer(cfg, params, TrainConfig(batch=8, micro_batch=2, recompute="every"), ADAM, CPU32)
    if kind.startswith("streamed"):
        tail = int(kind[-1])
        return StreamTrainer(cfg, params, StreamConfig(batch=8, micro_batch=4, tail=tail), ADAM, CPU32)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    return AutogradTrainer(params, lambda x, y: models.loss(params, x, y, cfg, seed=7),
                           torch.optim.AdamW(leaves, lr=ADAM.lr), cfg,
                           eval_fn=lambda x, y: models.loss(params, x, y, cfg))


@pytest.mark.parametrize("cfg", [DROP, LLAMA_DROP], ids=["gpt2", "llama"])
@pytest.mark.parametrize("kind", ["resident", "streamed0", "streamed2", "autograd"])
def test_eval_loss_is_the_loss_without_dropout_and_leaves_training_alone(kind, cfg):
    vocab = model_spec(cfg).vocab_size
    val = list(_batches(3, vocab=vocab))[-1]
    plain, evaluated = make(kind, cfg), make(kind, cfg)
    batches = [list(_batches(2, vocab=vocab)), list(_batches(2, vocab=vocab))]
    for t, bs in zip((plain, evaluated), batches):
        for x, y in bs:
            t.step(x, y)
    got = evaluated.eval_loss(*val)
    with torch.no_grad():
        want = models.loss(evaluated.master_params(), val[0], val[1], cfg).item()
    assert abs(got - want) <= chain_rtol(model_chain(cfg, val[0].shape[1], val[0].numel(), "loss")) * abs(want)
    x, y = next(_batches(1, vocab=vocab))  # a step after evaluating is the step without it, bit for bit
    assert plain.step(x, y).loss == evaluated.step(x, y).loss
    for (path, a), (_, b) in zip(named_leaves(plain.master_params()), named_leaves(evaluated.master_params())):
        assert torch.equal(a, b), path
    plain.close()
    evaluated.close()


def test_the_hook_evaluates_every_n_steps_and_after_the_last():
    trainer = make("resident")
    val = list(_batches(2))
    batches = _batches(5)
    records = loop.run(trainer, lambda: next(batches), LoopConfig(5, 8, 16), [], torch.device("cpu"),
                       hooks=[Evaluator(trainer, val, every=2, last_step=5)])
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4, 5]
    last = records[-1]
    with torch.no_grad():
        params = trainer.master_params()
        losses = [(models.loss(params, x, y, DROP).item(), int((y != -100).sum())) for x, y in val]
    want = sum(v * n for v, n in losses) / sum(n for _, n in losses)
    rtol = chain_rtol(model_chain(DROP, 16, sum(n for _, n in losses), "loss"))  # one forward in two orders
    assert last["val_loss"] == pytest.approx(want, rel=rtol)
    # exp turns the loss's absolute error into a relative one, and rounds once more
    assert last["val_ppl"] == pytest.approx(torch.tensor(want).exp().item(), rel=rtol * want + U32)
    trainer.close()


def test_held_out_split_and_bad_settings():
    train, val = TokenData("ids", torch.arange(100)).split(0.1)
    assert train.tokens.tolist() == list(range(90)) and val.tokens.tolist() == list(range(90, 100))
    with pytest.raises(ValueError, match="--val-fraction 1.5 must be between 0 and 1"):
        TokenData("ids", torch.arange(100)).split(1.5)
    with pytest.raises(ValueError, match="--eval-every -1"):
        Evaluator(None, [(None, None)], -1, 5)


PCFG = preset("tiny", n_layer=4, n_embd=32, n_head=4, n_ctx=16, vocab_size=256)


def _pipeline_worker():
    """Validation, a step, validation, a step on a pipeline: the losses, and each step's gradients (this rank's
    stage's) as AdamW applied them."""
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(pp=launched_world_size()), "gloo", timeout_s=60)
    g = torch.Generator().manual_seed(0)
    x, y, vx, vy = (torch.randint(0, 256, (8, 16), generator=g) for _ in range(4))
    out, grads = [], []
    with ctx.guard():
        pipe = build_pipeline(ctx, LayeredModel.from_spec(PCFG, 16), build_schedule("1f1b", ctx.world_size, 4, 1),
                              x[:2], seed=0)
        trainer = PipelineTrainer(pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2), 4)
        for _ in range(2):
            out += [trainer.eval_loss(vx, vy), trainer.step(x, y).loss]
            grads.append({path: t.grad.clone() for path, t in pipe.named_parameters()})
    close_distributed(ctx)
    return out, grads


def test_pipeline_eval_loss_matches_one_process():
    """Each loss within the chain's bound (the stages sum the same forward in other orders) plus, after the first
    update, what the weights' distance moves it: to first order the reference's gradient of that loss times what
    AdamW makes of the gradients each side applied (``conftest.adam_bounds``), over both ranks' stages."""
    per_rank = spawn(_pipeline_worker, 2, timeout_s=120, start_method="fork")
    params = models.init_params(PCFG, seed=0)
    start = {p: t.detach().clone() for p, t in named_leaves(params)}
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    opt = torch.optim.AdamW(leaves, lr=1e-2)
    g = torch.Generator().manual_seed(0)
    x, y, vx, vy = (torch.randint(0, 256, (8, 16), generator=g) for _ in range(4))
    want, val_grads, ref_grads = [], [], []
    for _ in range(2):
        opt.zero_grad()
        val = models.loss(params, vx, vy, PCFG)
        val.backward()
        val_grads.append({path: t.grad.clone() for path, t in named_leaves(params)})
        opt.zero_grad()
        loss = models.loss(params, x, y, PCFG)
        loss.backward()
        ref_grads.append({path: t.grad.clone() for path, t in named_leaves(params)})
        opt.step()
        want += [val.item(), loss.item()]
    rtol = chain_rtol(model_chain(PCFG, 16, 8 * 16, "loss"))
    hp = AdamConfig(lr=1e-2, weight_decay=0.01)  # torch.optim.AdamW's defaults
    moved = [0.0] * 4  # validation, step, validation, step
    for _, grads in per_rank:  # each rank's stage (a tied copy counted on both only widens the bound)
        aparts, step_moved = adam_bounds({p: start[p] for p in grads[0]}, grads, ref_grads, hp)
        moved[2] += sum(float((val_grads[1][p].abs().reshape(-1) * a[0]).sum()) for p, a in aparts.items())
        moved[3] += step_moved[1]
    for got, _ in per_rank:  # every rank has the losses
        for s, (a, b) in enumerate(zip(got, want, strict=True)):
            assert abs(a - b) <= rtol * b + moved[s], (s, a, b, moved[s])


def test_finetune_logs_validation(offline_files, tmp_path, monkeypatch, capsys):
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    base = ["--model", "tiny", "--batch", "4", "--micro-batch", "2", "--seq", "32", "--data", str(SHAKESPEARE),
            "--tokenizer-dir", str(TOKENIZER_DIR), "--out", "run", "--lr", "1e-3", "--no-tensorboard"]
    main(base + ["--steps", "3", "--val-fraction", "0.05", "--eval-every", "2", "--eval-batches", "2"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 3]
    assert "val loss" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="needs held-out data: add --val-fraction"):
        main(base + ["--steps", "1", "--eval-every", "2", "--out", "run2"])
