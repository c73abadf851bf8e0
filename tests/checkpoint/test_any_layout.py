"""One checkpoint format, any layout back (issue 39, item 3): a ZeRO-1, -2 and -3 checkpoint saved at 3 ranks
resumes as one process, as DDP at 2 ranks, and at the 3D layouts tp 2 and pp 2; a one-process checkpoint
resumes under ZeRO at 2 ranks and at tp 2; and a checkpoint of the old one-process layout (a Hugging Face
folder and ``optimizer.safetensors``) resumes through the one reader. Each continues the single-process run's
losses.

Bounds: a resume at the data-parallel engine's layouts differs from the single process only in the order of
the gradients' sums over ranks and micro-batches, fp32: 1e-6 relative on the loss; at 3D layouts the
tensor-parallel matmuls split their inner sums too and the pipeline reorders the loss's sum: 1e-5. Not derived
(measured <= 7.6e-8): every loss here follows at least one update from gradients these runs do not record, and
``conftest.adam_bounds`` needs both sides' (the engines' own tests record and derive them).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanotrain.checkpoint.resume import load_masters, restore
from nanotrain.checkpoint.state import save_checkpoint
from nanotrain.compose import Parallel3DTrainer, build_3d
from nanotrain.core.models import init_params, model_spec, preset
from nanotrain.core.models.run import tree_from
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.data import DataPosition
from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.distributed import GridConfig, build_grid, close_distributed, init_distributed, spawn
from nanotrain.pipeline import build_schedule
from tests.data_parallel.dp_cases import batches

CFG = preset("tiny", n_layer=4, n_embd=32, n_head=4, vocab_size=512, n_ctx=16)  # no dropout: 3D runs it too
ADAM = AdamConfig(lr=1e-3, eps=1e-6, weight_decay=0.1)
OCFG = OffloadConfig(device="cpu", dtype=torch.float32, offload=False, state_bits=32)
BATCH, MICRO, SEQ = 12, 2, 16  # those of ``batches``
TCFG = TrainConfig(batch=BATCH, micro_batch=MICRO, recompute="every")
DP_TOL, TOL_3D = 1e-6, 1e-5  # the module docstring says why


def one_process(ckpt=None) -> list[float]:
    """The single process's losses: every step from the start, or the steps after ``ckpt``."""
    trainer = ResidentTrainer(CFG, init_params(CFG, seed=1), TCFG, ADAM, OCFG)
    done = 0 if ckpt is None else (restore(trainer, ckpt), trainer.step_count)[1]
    losses = [trainer.step(x, y).loss for x, y in batches()[done:]]
    trainer.close()
    return losses


def data_parallel(zero: int, group, seed: int = 2) -> object:
    """A data-parallel trainer from weights of ``seed`` (1: the single process's; others: what a restore replaces)."""
    return data_parallel_trainer(CFG, init_params(CFG, seed=seed), TCFG, ADAM, OCFG,
                                 DPConfig(zero=zero, bucket_mb=0.05), group)


def three_d(ctx, grid: GridConfig) -> Parallel3DTrainer:
    ctx.grid = build_grid(grid)
    p3d = build_3d(ctx, CFG, build_schedule("1f1b", grid.pp, MICRO), SEQ, BATCH // (grid.dp * MICRO), seed=3)
    return Parallel3DTrainer(p3d, ADAM, OCFG, DPConfig(zero=0, bucket_mb=0))


def resumed(trainer, ckpt) -> list[float]:
    restore(trainer, ckpt)
    assert trainer.step_count == 1
    losses = [trainer.step(x, y).loss for x, y in batches()[1:]]
    trainer.close()
    return losses


def save_at_three(run: str) -> None:
    """ZeRO-1, -2 and -3 at 3 ranks: one step, saved."""
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=3), "gloo", timeout_s=60)
    with ctx.guard():
        for zero in (1, 2, 3):
            trainer = data_parallel(zero, dist.group.WORLD, seed=1)
            trainer.step(*batches()[0])
            save_checkpoint(f"{run}/zero{zero}", trainer, DataPosition(0, 12))
            trainer.close()
    close_distributed(ctx)


def resume_at_two(run: str) -> dict:
    """Each ZeRO checkpoint as DDP at 2 ranks, at tp 2 and at pp 2; the one-process one under ZeRO-2 and at tp 2."""
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=2), "gloo", timeout_s=60)
    out = {}
    with ctx.guard():
        for zero in (1, 2, 3):
            ckpt = f"{run}/zero{zero}/step-000001"
            out[f"zero{zero} ddp"] = resumed(data_parallel(0, dist.group.WORLD), ckpt)
            out[f"zero{zero} tp2"] = resumed(three_d(ctx, GridConfig(tp=2, pp=1, dp=1)), ckpt)
            out[f"zero{zero} pp2"] = resumed(three_d(ctx, GridConfig(tp=1, pp=2, dp=1)), ckpt)
        out["one zero2"] = resumed(data_parallel(2, dist.group.WORLD), f"{run}/one/step-000001")
        out["one tp2"] = resumed(three_d(ctx, GridConfig(tp=2, pp=1, dp=1)), f"{run}/one/step-000001")
    close_distributed(ctx)
    return out


def close(ours: list[float], ref: list[float], tol: float) -> bool:
    return len(ours) == len(ref) and all(abs(a - b) <= tol * abs(b) for a, b in zip(ours, ref))


def test_a_checkpoint_of_any_layout_resumes_at_any_other(tmp_path):
    ref = one_process()
    first = ResidentTrainer(CFG, init_params(CFG, seed=1), TCFG, ADAM, OCFG)
    first.step(*batches()[0])
    save_checkpoint(tmp_path / "one", first, DataPosition(0, 12))
    first.close()
    spawn(save_at_three, 3, (str(tmp_path),), start_method="fork", timeout_s=120)
    for zero in (1, 2, 3):  # as one process
        assert close(one_process(tmp_path / f"zero{zero}" / "step-000001"), ref[1:], DP_TOL), zero
    for result in spawn(resume_at_two, 2, (str(tmp_path),), start_method="fork", timeout_s=120):
        for name, losses in result.items():
            assert close(losses, ref[1:], TOL_3D if name.endswith(("tp2", "pp2")) else DP_TOL), (name, losses, ref)


def test_the_old_one_process_layout_resumes_through_the_one_reader(tmp_path):
    """Written as the one-process writer before the one format wrote it: the model file, ``optimizer.safetensors``
    (``master.<path>``, moments, step counts), ``trainer.json``; no manifest."""
    from safetensors.torch import save_file

    from weights import save_hf

    trainer = ResidentTrainer(CFG, init_params(CFG, seed=1), TCFG, ADAM, OCFG)
    trainer.step(*batches()[0])
    old = tmp_path / "step-000001"
    save_hf(trainer.master_params(), CFG, old, max_shard_bytes=None)
    save_file({k: v.contiguous() for k, v in trainer.state_dict().items()}, old / "optimizer.safetensors")
    (old / "trainer.json").write_text('{"step": 1, "data_position": {"epoch": 0, "index": 12}, "meta": {}}')
    saved = {k.removeprefix("master."): t.clone() for k, t in trainer.state_dict().items() if k.startswith("master.")}
    expected = [trainer.step(x, y).loss for x, y in batches()[1:]]
    trainer.close()
    masters = load_masters(old)
    assert masters.keys() == saved.keys() and all(torch.equal(masters[p], saved[p]) for p in saved)
    again = ResidentTrainer(CFG, tree_from(model_spec(CFG), load_masters(old).items()), TCFG, ADAM, OCFG)
    assert restore(again, old) == DataPosition(0, 12) and again.step_count == 1
    assert [again.step(x, y).loss for x, y in batches()[1:]] == expected  # bit for bit: the same state
    again.close()
