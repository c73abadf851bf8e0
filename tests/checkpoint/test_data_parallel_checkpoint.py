"""Sharded ZeRO checkpoints: saved at 3 ranks, resumed at 3 (the uninterrupted run's losses, bit for
bit), at 3 with another ZeRO stage and layout, at 2 under ZeRO-3 and as one process, each continuing
with the single-process run's losses; the fp32 export loads into transformers. 8-bit moments
(quantized per leaf in blocks that every piece starts on) resume bit for bit at their own layout and
within rounding of the sums at another ZeRO stage and bucket size; another tensor-parallel cut is refused."""
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
from tests.conftest import assert_same_logits
from tests.data_parallel.test_data_parallel import ADAM, CFG, CPU32, TCFG, batches, make_dp, single_process

SAVED = DPConfig(zero=2, bucket_mb=0.3)


def continue_from(ckpt, dcfg: DPConfig) -> list[float]:
    trainer = make_dp(dcfg)
    position = restore(trainer, ckpt)
    assert position == DataPosition(0, 12) and trainer.step_count == 1
    losses = [trainer.step(x, y).loss for x, y in batches()[1:]]
    trainer.close()
    return losses


def save_at_three(run) -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "gloo", timeout_s=60)
    with ctx.guard():
        trainer = make_dp(SAVED)
        data = batches()
        losses = [trainer.step(*data[0]).loss]
        ckpt = save_checkpoint(run, trainer, DataPosition(0, 12))
        losses += [trainer.step(x, y).loss for x, y in data[1:]]
        trainer.close()
        out = {"uninterrupted": losses, "same": continue_from(ckpt, SAVED),
               "resharded": continue_from(ckpt, DPConfig(zero=1, bucket_mb=0)), "8-bit": eight_bit(run.parent / "8")}
    close_distributed(ctx)
    return out


def eight_bit(run) -> tuple[list[float], list[float], list[float], str]:
    """8-bit moments under ZeRO: a sharded checkpoint resumes at its own layout and at another ZeRO stage
    and bucket size, and refuses a tensor-parallel cut."""
    ocfg = replace(CPU32, state_bits=8, min_8bit_numel=1024)
    make = lambda dcfg: data_parallel_trainer(CFG, init_params(CFG, seed=1), TCFG, ADAM, ocfg, dcfg,  # noqa: E731
                                              dist.group.WORLD)
    trainer, data = make(SAVED), batches()
    trainer.step(*data[0])
    ckpt = save_checkpoint(run, trainer, DataPosition(0, 12))
    uninterrupted = [trainer.step(x, y).loss for x, y in data[1:]]
    trainer.close()
    again = make(SAVED)
    restore(again, ckpt)
    resumed = [again.step(x, y).loss for x, y in data[1:]]
    again.close()
    other = make(DPConfig(zero=1, bucket_mb=0))
    restore(other, ckpt)
    resharded = [other.step(x, y).loss for x, y in data[1:]]
    other.close()
    try:
        check_resumable(ckpt, tp=2)
        refused = ""
    except CheckpointError as e:
        refused = str(e)
    return uninterrupted, resumed, resharded, refused


def resume_at_two(run) -> list[float]:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "gloo", timeout_s=60)
    with ctx.guard():
        losses = continue_from(find_checkpoint(run).path, DPConfig(zero=3))
    close_distributed(ctx)
    return losses


def test_sharded_checkpoint_resumes_at_any_world_size(tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    at_three = spawn(save_at_three, 3, (run,), start_method="fork", timeout_s=120)
    ckpt = find_checkpoint(run).path
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "SHA256SUMS", "config.json", "manifest.json", *(f"shard-0000{r}-of-00003.safetensors" for r in range(3)),
        "trainer.json"]
    assert incomplete(ckpt) is None and not [p for p in run.iterdir() if p.name.startswith(".")]  # published whole
    ref = single_process()["losses"]
    for r in at_three:
        assert r["same"] == r["uninterrupted"][1:]
        uninterrupted, resumed, resharded, refused = r["8-bit"]
        assert resumed == uninterrupted, (resumed, uninterrupted)
        assert all(abs(a - b) <= 1e-6 * b for a, b in zip(resharded, uninterrupted)), (resharded, uninterrupted)
        assert "8-bit moments quantized per leaf as held at whole leaves (no tensor parallelism)" in refused
        for losses in (r["uninterrupted"][1:], r["resharded"]):
            assert all(abs(a - b) <= 1e-6 * b for a, b in zip(losses, ref[1:])), (losses, ref)
    for losses in spawn(resume_at_two, 2, (run,), start_method="fork", timeout_s=120):
        assert all(abs(a - b) <= 1e-6 * b for a, b in zip(losses, ref[1:])), (losses, ref)

    params = tree_from(model_spec(CFG), load_masters(ckpt).items())
    one = ResidentTrainer(CFG, params, TCFG, ADAM, CPU32)
    assert restore(one, ckpt) == DataPosition(0, 12) and one.step_count == 1
    losses = [one.step(x, y).loss for x, y in batches()[1:]]
    one.close()
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(losses, ref[1:])), (losses, ref)

    export_checkpoint(ckpt, tmp_path / "hf", CFG, ecfg=ExportConfig(torch.float32))  # the masters themselves
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    params = tree_from(model_spec(CFG), load_masters(ckpt).items())
    tokens = batches()[0][0][:2]
    with torch.no_grad():
        assert_same_logits(logits(params, tokens, CFG), hf(input_ids=tokens).logits, CFG)
