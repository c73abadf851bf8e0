"""Sharded ZeRO checkpoints: saved at 3 ranks, resumed at 3 (the uninterrupted run's losses, bit for
bit), at 3 with another ZeRO stage and layout, at 2 under ZeRO-3 and as one process, each continuing
with the single-process run's losses and state (within what AdamW makes of the gradients each side applied);
the fp32 export loads into transformers. 8-bit moments
(quantized per leaf in blocks that every piece starts on) resume bit for bit at their own layout and at another
ZeRO stage and bucket size within the sums' reorder plus what the masters' measured distance moves each loss;
another tensor-parallel cut is refused."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from nanotrain.core.models import init_params, logits, model_spec
from nanotrain.core.models.run import tree_from
from nanotrain.data import DataPosition
from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.checkpoint.export import ExportConfig, export_checkpoint
from nanotrain.checkpoint.resume import check_resumable, load_masters, restore
from nanotrain.checkpoint.state import save_checkpoint
from nanotrain.checkpoint.run_dir import incomplete
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from nanotrain.core.train.resident import ResidentTrainer
from nanotrain.checkpoint.run_dir import find_checkpoint
from weights.safetensors_io import CheckpointError
from tests.conftest import assert_same_logits, moved_by
from tests.data_parallel.dp_cases import (ADAM, CFG, CPU32, SAME_LOSS_RTOL, TCFG, assert_steps_match, batches, buckets,
                                          make_dp, reduced_grads, single_process, spied)

SAVED = DPConfig(zero=2, bucket_mb=0.3)


def continue_from(ckpt, dcfg: DPConfig) -> dict:
    """The steps after ``ckpt``'s, as ``test_data_parallel.run_steps`` records them (no validation)."""
    grads = []
    trainer = spied(make_dp(dcfg), grads)
    position = restore(trainer, ckpt)
    assert position == DataPosition(0, 12) and trainer.step_count == 1
    return finish([(grads.append([]), trainer.step(x, y).loss)[1] for x, y in batches()[1:]], grads, trainer)


def finish(losses: list[float], grads: list, trainer) -> dict:
    out = {"losses": losses, "grads": grads, "state": {k: v.clone() for k, v in trainer.state_dict().items()},
           "buckets": buckets(trainer)}
    trainer.close()
    return out


def save_at_three(run) -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "gloo", timeout_s=60)
    with ctx.guard():
        grads = []
        trainer = spied(make_dp(SAVED), grads)
        data = batches()
        losses = [(grads.append([]), trainer.step(*data[0]).loss)[1]]
        ckpt = save_checkpoint(run, trainer, DataPosition(0, 12))
        losses += [(grads.append([]), trainer.step(x, y).loss)[1] for x, y in data[1:]]
        out = {"uninterrupted": finish(losses, grads, trainer), "same": continue_from(ckpt, SAVED)["losses"],
               "resharded": continue_from(ckpt, DPConfig(zero=1, bucket_mb=0)), "8-bit": eight_bit(run.parent / "8")}
    close_distributed(ctx)
    return out


def eight_bit(run) -> tuple[dict, list[float], dict, str]:
    """8-bit moments under ZeRO: a sharded checkpoint resumes at its own layout and at another ZeRO stage
    and bucket size, and refuses a tensor-parallel cut."""
    ocfg = replace(CPU32, state_bits=8, min_8bit_numel=1024)
    make = lambda dcfg: data_parallel_trainer(CFG, init_params(CFG, seed=1), TCFG, ADAM, ocfg, dcfg,  # noqa: E731
                                              dist.group.WORLD)
    trainer, data = make(SAVED), batches()
    trainer.step(*data[0])
    ckpt = save_checkpoint(run, trainer, DataPosition(0, 12))
    uninterrupted = recorded(trainer, data[1:], run.parent / "8-uninterrupted")
    again = make(SAVED)
    restore(again, ckpt)
    resumed = [again.step(x, y).loss for x, y in data[1:]]
    again.close()
    other = make(DPConfig(zero=1, bucket_mb=0))
    restore(other, ckpt)
    resharded = recorded(other, data[1:], run.parent / "8-resharded")
    try:
        check_resumable(ckpt, tp=2)
        refused = ""
    except CheckpointError as e:
        refused = str(e)
    return uninterrupted, resumed, resharded, refused


def recorded(trainer, data: list, run) -> dict:
    """Steps on ``data``: the losses, the reduced gradients (``spied``) and the masters each step started from, saved
    into ``run`` and read back whole (8-bit moments are never gathered: no state is)."""
    grads, before, losses = [], [], []
    spied(trainer, grads)
    for x, y in data:
        before.append(load_masters(save_checkpoint(run, trainer, DataPosition(0, 12))))
        losses.append((grads.append([]), trainer.step(x, y).loss)[1])
    trainer.close()
    return {"losses": losses, "grads": grads, "buckets": buckets(trainer), "before": before}


def resume_at_two(run) -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "gloo", timeout_s=60)
    with ctx.guard():
        out = continue_from(find_checkpoint(run).path, DPConfig(zero=3))
    close_distributed(ctx)
    return out


def test_sharded_checkpoint_resumes_at_any_world_size(tmp_path):
    """Every run against one process's, from the gradients each side applied (``test_data_parallel``'s
    ``assert_steps_match``): a resumed run's first step is the saved run's."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    at_three = spawn(save_at_three, 3, (run,), start_method="fork", timeout_s=120)
    ckpt = find_checkpoint(run).path
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "SHA256SUMS", "config.json", "manifest.json", *(f"shard-0000{r}-of-00003.safetensors" for r in range(3)),
        "trainer.json"]
    assert incomplete(ckpt) is None and not [p for p in run.iterdir() if p.name.startswith(".")]  # published whole
    ref = single_process()
    saved = [r["uninterrupted"] for r in at_three]
    assert_steps_match(saved, [reduced_grads(saved, SAVED.zero, s) for s in range(3)], ref, "saved at 3")
    first = saved[0]["losses"][:1], reduced_grads(saved, SAVED.zero)  # the saved run's first step

    def assert_resumed(runs: list[dict], zero: int, what: str) -> None:
        grads = [first[1]] + [reduced_grads(runs, zero, s) for s in range(2)]
        assert_steps_match([{**r, "losses": first[0] + r["losses"]} for r in runs], grads, ref, what)

    eight_bit_grads = [reduced_grads([r["8-bit"][0] for r in at_three], SAVED.zero, s) for s in range(2)]
    uninterrupted_before, resharded_before = (at_three[0]["8-bit"][i]["before"] for i in (0, 2))
    for r in at_three:
        assert r["same"] == r["uninterrupted"]["losses"][1:]
        uninterrupted, resumed, resharded, refused = r["8-bit"]
        assert resumed == uninterrupted["losses"], (resumed, uninterrupted["losses"])
        # each step the sum's reorder (test_data_parallel) plus what the masters it started from, measured apart,
        # move its loss (conftest.moved_by: after an 8-bit update a rounding-level moment difference may move a
        # quantized moment by a code, which no fp32 bound covers); the first from the same state, none apart
        for s, (a, b) in enumerate(zip(resharded["losses"], uninterrupted["losses"], strict=True)):
            moved = moved_by(eight_bit_grads[s], resharded_before[s], uninterrupted_before[s])
            assert abs(a - b) <= SAME_LOSS_RTOL * b + moved, (s, resharded["losses"], uninterrupted["losses"])
        assert "8-bit moments quantized per leaf as held at whole leaves (no tensor parallelism)" in refused
    assert_resumed([r["resharded"] for r in at_three], 1, "resharded at 3")
    assert_resumed(spawn(resume_at_two, 2, (run,), start_method="fork", timeout_s=120), 3, "resumed at 2")

    params = tree_from(model_spec(CFG), load_masters(ckpt).items())
    one = ResidentTrainer(CFG, params, TCFG, ADAM, CPU32)
    assert restore(one, ckpt) == DataPosition(0, 12) and one.step_count == 1
    losses, grads = [], [first[1]]
    for x, y in batches()[1:]:
        losses.append(one.step(x, y).loss)
        grads.append({p: t.clone() for p, t in one.weights.accum.items()})
    state = {k: v.clone() for k, v in one.state_dict().items()}
    one.close()
    assert_steps_match([{"losses": first[0] + losses, "state": state}], grads, ref, "resumed as one process")

    export_checkpoint(ckpt, tmp_path / "hf", CFG, ecfg=ExportConfig(torch.float32))  # the masters themselves
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    params = tree_from(model_spec(CFG), load_masters(ckpt).items())
    tokens = batches()[0][0][:2]
    with torch.no_grad():
        assert_same_logits(logits(params, tokens, CFG), hf(input_ids=tokens).logits, CFG)
