"""On 2 GPUs with NCCL (skipped elsewhere): DDP and ZeRO-1/2/3 (ZeRO-3 also keeping its graphs) in fp32, with
masters and moments in host memory and on the GPU, and weight streaming with sharded masters and moments (on one GPU
too, as a world of one), equal one process on the same GPU (its losses, masters and moments after 3 steps, and the
validation loss right after them: ZeRO-3's waits for the updates on its side stream), and bf16 reduction stays
close; with clipping (triggered every step) and with fp16 loss scaling (overflowing steps included), each stage
takes the one-GPU trainer's steps: the same clip flags, skips and scales, and masters close, and so does weight
streaming's deferred step. This exercises what the CPU tests cannot: the side streams, NCCL's asynchronous
collectives and the copies between host and device.

    python -m pytest -q tests/data_parallel/test_data_parallel_cuda.py
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from nanotrain.core.models import init_params, model_spec, preset
from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.stream.zero_offload import zero_offload_trainer
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from nanotrain.core.optim import OffloadConfig
from nanotrain.core.train.resident import ResidentTrainer
from nanotrain.core.train.scaler import LossScaler, ScalerConfig
from nanotrain.stream.trainer import StreamConfig, StreamTrainer
from tests.data_parallel.dp_cases import ADAM, CFG, TCFG, VAL, batches
from tests.stream.test_data_parallel_streamed import assert_state_matches
from tests.stream.test_data_parallel_streamed import SCFG


STAGES = {"ddp": DPConfig(zero=0, bucket_mb=0.3, check_replicas=True), "zero1": DPConfig(zero=1, bucket_mb=0.3),
          "zero2": DPConfig(zero=2, bucket_mb=0), "zero3": DPConfig(zero=3)}
# each stage with the test's recompute (every block), and ZeRO-3 keeping its graphs (its gathered weights released
# under them and gathered back, the host paced to the GPU's reductions) as well
RUNS = [(name, dcfg, TCFG) for name, dcfg in STAGES.items()] + [("zero3 kept", STAGES["zero3"],
                                                                  replace(TCFG, recompute="none"))]


def three_steps(make) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The steps' losses and the validation loss right after them (which waits for the last updates), the state."""
    trainer = make()
    losses = [trainer.step(x, y).loss for x, y in batches()] + [trainer.eval_loss(*VAL)]
    state = {k: v.cpu().clone() for k, v in trainer.state_dict().items()}
    trainer.close()
    return losses, state


def flagged_steps(make, scaler: ScalerConfig | None, data=None) -> tuple[list[tuple], dict[str, torch.Tensor]]:
    """Each step's (loss, clipped, skipped, loss scale), and the masters after them."""
    trainer = make()
    if scaler is not None:
        getattr(trainer, "inner", trainer).scaler = LossScaler(scaler)
    results = [trainer.step(x, y) for x, y in data or batches()]
    masters = {k: v.cpu().clone() for k, v in trainer.state_dict().items() if k.startswith("master.")}
    trainer.close()
    return [(r.loss, r.clipped, r.skipped, r.loss_scale) for r in results], masters


def clip_and_fp16(ctx, where: str) -> list[str]:
    """Clipping by 0.05 (every step) in fp32, and fp16 from a scale that overflows: each stage against one GPU."""
    failures = []
    for dtype, scaler in ((torch.float32, None), (torch.float16, ScalerConfig(init_scale=2.0 ** 20))):
        ocfg = OffloadConfig(device=str(ctx.device), dtype=dtype, offload=where == "host",
                             exact_skip=dtype == torch.float16)
        tcfg = replace(TCFG, clip_norm=0.05 if dtype == torch.float32 else None)
        ref, ref_masters = flagged_steps(lambda: ResidentTrainer(CFG, init_params(CFG, seed=1), tcfg, ADAM, ocfg),
                                         scaler)
        for name, dcfg in STAGES.items():
            ours, masters = flagged_steps(lambda: data_parallel_trainer(
                CFG, init_params(CFG, seed=1), tcfg, ADAM, ocfg, dcfg, ctx.grid.dp_group), scaler)
            worst = max(((masters[k] - v).norm() / v.norm()).item() for k, v in ref_masters.items()) if masters else 0
            if [r[1:] for r in ours] != [r[1:] for r in ref] or worst > 1e-3 or not all(
                    abs(a[0] - b[0]) <= 1e-3 * b[0] for a, b in zip(ours, ref)):
                failures.append(f"rank {ctx.rank} {name} {dtype} states on {where}: {ours} vs {ref}, masters {worst}")
    return failures


def worker() -> list[str]:
    """Every check's failure, as text (nothing when all pass)."""
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "nccl", timeout_s=120)
    failures = []
    with ctx.guard():
        for where in ("host", "gpu"):
            ocfg = OffloadConfig(device=str(ctx.device), dtype=torch.float32, offload=where == "host")
            ref_losses, ref_state = three_steps(lambda: ResidentTrainer(CFG, init_params(CFG, seed=1), TCFG, ADAM,
                                                                        ocfg))
            for name, dcfg, tcfg in RUNS:
                losses, state = three_steps(lambda: data_parallel_trainer(
                    CFG, init_params(CFG, seed=1 + ctx.rank), tcfg, ADAM, ocfg, dcfg, ctx.grid.dp_group))
                try:
                    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(losses, ref_losses)), (losses, ref_losses)
                    if ctx.rank == 0:
                        assert_state_matches(state, ref_state, f"{name} {where}", tol=1e-5)
                except AssertionError as e:
                    failures.append(f"rank {ctx.rank} {name} states on {where}: {e}")
            bf16 = replace(STAGES["zero2"], reduce_dtype=torch.bfloat16)
            losses, _ = three_steps(lambda: data_parallel_trainer(CFG, init_params(CFG, seed=1), TCFG, ADAM, ocfg,
                                                                  bf16, ctx.grid.dp_group))
            if not all(abs(a - b) <= 1e-3 * b for a, b in zip(losses, ref_losses)):
                failures.append(f"rank {ctx.rank} bf16 reduction on {where}: {losses} vs {ref_losses}")
            failures += clip_and_fp16(ctx, where)
    close_distributed(ctx)
    return failures


def streamed_worker() -> list[str]:
    """Weight streaming with sharded masters and moments against one process's StreamTrainer on the same GPU:
    its side streams, pinned copies and NCCL's collectives together. The tiny model in fp32 with 32- and
    8-bit moments; gpt2's shapes in bf16, where copies take long enough for a missing wait to show. On
    one GPU (a world of one) the runs must agree bit for bit."""
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "nccl", timeout_s=120)
    gpt2 = preset("gpt2", n_layer=4)
    g = torch.Generator().manual_seed(0)
    vocab = model_spec(gpt2).vocab_size
    large = [(x, x.roll(-1, 1)) for x in (torch.randint(0, vocab, (8, 256), generator=g) for _ in range(3))]
    runs = [(CFG, SCFG, torch.float32, 32, batches()), (CFG, SCFG, torch.float32, 8, batches()),
            (gpt2, StreamConfig(8, 2, on_host=2), torch.bfloat16, 32, large)]
    failures = []
    with ctx.guard():
        for cfg, scfg, dtype, bits, data in runs:
            ocfg = OffloadConfig(device=str(ctx.device), dtype=dtype, state_bits=bits, min_8bit_numel=1024,
                                 keep_32bit=model_spec(cfg).fp32_moments)
            ref = StreamTrainer(cfg, init_params(cfg, seed=1), scfg, ADAM, ocfg)
            ref_losses = [ref.step(x, y).loss for x, y in data]
            ref_state = {k: v.cpu().clone() for k, v in ref.state_dict().items()}
            ref.close()
            trainer = zero_offload_trainer(cfg, init_params(cfg, seed=1 + ctx.rank), scfg, ADAM, ocfg,
                                           DPConfig(check_replicas=True), ctx.grid.dp_group)
            losses = [trainer.step(x, y).loss for x, y in data]
            state = {k: v.cpu().clone() for k, v in trainer.state_dict().items()} if bits == 32 else {}
            trainer.close()
            what = f"rank {ctx.rank} streamed {model_spec(cfg).costs.width}-wide {dtype} {bits}-bit"
            try:
                if ctx.world_size == 1:
                    assert losses == ref_losses, (losses, ref_losses)
                    assert all(torch.equal(state[k], ref_state[k]) for k in state), "state differs"
                    continue
                # 8-bit: a moment may cross a code boundary (see test_data_parallel_streamed); bf16: other sums
                tol = 1e-5 if dtype == torch.float32 else 1e-3
                assert all(abs(a - b) <= tol * b for a, b in zip(losses, ref_losses)), (losses, ref_losses)
                if ctx.rank == 0 and bits == 32 and dtype == torch.float32:
                    assert_state_matches(state, ref_state, what, tol=1e-5)
            except AssertionError as e:
                failures.append(f"{what}: {e}")
        failures += streamed_clip_and_fp16(ctx, gpt2, large)
    close_distributed(ctx)
    return failures


def streamed_clip_and_fp16(ctx, gpt2: Any, large: list) -> list[str]:
    """The deferred step under data parallelism (``stream/sharded_deferred.py``: reduced shards copied to
    pinned memory on a side stream while backward goes on, brought back for the update pass) against
    one GPU's StreamTrainer: clipping by 0.05 (every step) in fp32 and in bf16 at gpt2's shapes, fp16
    from a scale that overflows, with clipping; the same flags, skips and scales, losses and masters
    close (bit for bit in a world of one)."""
    runs = [(CFG, replace(SCFG, clip_norm=0.05), torch.float32, None, batches()),
            (CFG, replace(SCFG, clip_norm=0.5), torch.float16, ScalerConfig(init_scale=2.0 ** 20), batches()),
            (gpt2, StreamConfig(8, 2, on_host=2, clip_norm=0.05), torch.bfloat16, None, large)]
    failures = []
    for cfg, scfg, dtype, scaler, data in runs:
        ocfg = OffloadConfig(device=str(ctx.device), dtype=dtype, keep_32bit=model_spec(cfg).fp32_moments)
        steps = lambda make: flagged_steps(make, scaler, data)  # noqa: E731
        ref, ref_masters = steps(lambda: StreamTrainer(cfg, init_params(cfg, seed=1), scfg, ADAM, ocfg))
        ours, masters = steps(lambda: zero_offload_trainer(cfg, init_params(cfg, seed=1), scfg, ADAM, ocfg,
                                                           DPConfig(check_replicas=True), ctx.grid.dp_group))
        gaps = {k: ((masters[k] - v).norm() / v.norm()).item() for k, v in ref_masters.items()} if masters else {}
        worst_key = max(gaps, key=gaps.get, default=None)
        worst = gaps.get(worst_key, 0)
        exact = ctx.world_size == 1 and (ours, worst) == (ref, 0)
        # bf16 on two ranks: other sums, and where a gradient is near zero its sign, and with it Adam's
        # early steps (about lr times the sign), may flip. On 2 H200s (2026-11-23, twice, the same figures)
        # a zero-initialized bias, qkv_b of norm 0.23 after 3 steps at lr 3e-3, moved 0.72%; every loss
        # agreed within 3e-7. A lost update moves a weight matrix tens of percent: 1e-2 still catches it.
        bound = 1e-2 if dtype == torch.bfloat16 else 1e-3
        close = [r[1:] for r in ours] == [r[1:] for r in ref] and worst <= bound and all(
            abs(a[0] - b[0]) <= 1e-3 * b[0] for a, b in zip(ours, ref))
        if not (exact if ctx.world_size == 1 else close):
            width = model_spec(cfg).costs.width
            failures.append(f"rank {ctx.rank} streamed {width}-wide {dtype} deferred: {ours} vs {ref}, "
                            f"masters {worst} ({worst_key}, norm {ref_masters[worst_key].norm():.4g})")
    return failures


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_data_parallel_on_two_gpus_equals_one_gpu():
    failures = [f for rank in spawn(worker, 2, timeout_s=600) for f in rank]
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_streamed_data_parallel_on_the_gpus_equals_one_gpu():
    failures = [f for rank in spawn(streamed_worker, min(2, torch.cuda.device_count()), timeout_s=600) for f in rank]
    assert not failures, "\n".join(failures)
