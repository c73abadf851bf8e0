"""1F1B's activation memory does not grow with the number of micro-batches; GPipe's does."""
from __future__ import annotations

import torch

from nanotrain.distributed import (GridConfig, close_distributed, init_distributed, launched_world_size,
                                   spawn)
from nanotrain.core.models import preset
from nanotrain.pipeline import ActivationMeter, LayeredModel, build_pipeline, build_schedule, train_step

# As small as a GPT-2 gets, so that 1000 micro-batches through 4 processes take seconds on 2 cores.
CFG = preset("tiny", n_layer=4, n_embd=8, n_head=2, n_ctx=4, vocab_size=16)
RUNS = [("1f1b", 16), ("1f1b", 1000), ("gpipe", 16), ("gpipe", 64)]


def peak_worker() -> dict[tuple[str, int], int]:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(pp=launched_world_size()), "gloo", timeout_s=60)
    peaks = {}
    with ctx.guard():
        for name, micro in RUNS:
            tokens = torch.randint(0, CFG.vocab_size, (micro, 1, CFG.n_ctx), generator=torch.Generator().manual_seed(0))
            schedule = build_schedule(name, ctx.world_size, micro)
            pipe = build_pipeline(ctx, LayeredModel.from_spec(CFG), schedule, tokens[0])
            meter = ActivationMeter(pipe.parameters())
            train_step(pipe, None, tokens, tokens, meter=meter)
            peaks[(name, micro)] = meter.peak
    close_distributed(ctx)
    return peaks


def test_1f1b_memory_is_flat_in_microbatches_and_gpipe_grows():
    per_rank = spawn(peak_worker, 4, timeout_s=240, start_method="fork")
    for rank, peaks in enumerate(per_rank):
        flat, grown = peaks[("1f1b", 1000)], peaks[("1f1b", 16)]
        assert 0 < flat <= grown, f"rank {rank}: 1F1B peak {flat} B with 1000 micro-batches > {grown} B with 16"
        assert peaks[("gpipe", 64)] > 3 * peaks[("gpipe", 16)], f"rank {rank}: GPipe peaks {peaks}"
    print({r: p for r, p in enumerate(per_rank)})
