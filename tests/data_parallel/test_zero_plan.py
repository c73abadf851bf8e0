"""The per-ZeRO-stage memory plan against a hand count, and tasks.finetune's refusal naming what would fit."""
from dataclasses import replace

import pytest

from nanotrain.core.models import preset
from nanotrain.core.machine import GIB
from nanotrain.data_parallel.footprint import zero_estimate
from nanotrain.plan.candidates import Ask, Box, Pins
from nanotrain.plan.search import search
from nanotrain.stream.search import GPUS

# c = 8: a block has 12 c^2 + 13 c = 872 parameters, the embeddings (100 + 16) c = 928, ln_f 2 c = 16,
# so n = 928 + 2 * 872 + 16 = 2688; over 2 ranks a shard is 1344, of which 928 / 2 = 464 are embeddings.
CFG = preset("tiny", n_layer=2, n_embd=8, n_head=2, vocab_size=100, n_ctx=16)
# One sequence of 16 tokens in bf16 (2 bytes) with recompute every: the saved block inputs 2 layers x 2 c x 16
# = 512 bytes, one block recomputed and back-propagated (``core.footprint.recompute_bytes``): 34 c x 16 = 4352
# saved, its backward's temporaries 6.5 bytes a token per output of the MLP's first matmul (the MLP's matrices'
# 2 x 32 x 8 parameters less the last matmul's 8 x 32 + 8, over c: 31) x 16 = 3224, its weight gradients in bf16
# 872 x 2 = 1744; the LM head: a chunk of 16 tokens x 128 (the padded vocabulary) x (4 + 2) = 12288, its fp32
# weight gradient 128 x 8 x 4 = 4096, the final hidden 16 x 8 x 2 = 256.
ACTIVATIONS = 512 + 4352 + 3224 + 1744 + 12288 + 4096 + 256


def test_each_stage_against_a_hand_count():
    want = {  # (weights, gradients, masters, moments) per GPU, bf16 compute, 32-bit moments, 2 ranks
        0: (2688 * 2, 2688 * 4, 2688 * 4, 2688 * 8),
        1: (2688 * 2 + 1344 * 2, 2688 * 4, 1344 * 4, 1344 * 8),  # the shard's weights, the gather's input
        2: (2688 * 2 + 1344 * 2, 2688 * 4 + 1344 * 4, 1344 * 4, 1344 * 8),
        # the shard (the gather's input), then gathered: the embeddings, ln_f and a block; gradients: the fp32
        # shard, the fp32 embeddings, ln_f and two blocks being reduced, and the embeddings' gradient in bf16
        3: (1344 * 2 + (928 + 16 + 872) * 2, 1344 * 4 + (928 + 16 + 2 * 872) * 4 + 928 * 2, 1344 * 4, 1344 * 8),
    }
    for zero, (weights, grads, masters, moments) in want.items():
        plan = zero_estimate(CFG, 2, zero, 1, 16, "every", states_on_gpu=True)
        assert (plan.weights, plan.gradients, plan.masters, plan.moments) == want[zero], zero
        assert plan.activations == ACTIVATIONS
        # the allocated peak: the headroom the allocator needs is the fit check's (``core.footprint.margin``)
        assert plan.total == weights + grads + masters + moments + ACTIVATIONS
        on_host = zero_estimate(CFG, 2, zero, 1, 16, "every")  # --states cpu: not on the GPU
        assert on_host.total == weights + grads + ACTIVATIONS
    # fp16's exact skips keep masters and moments twice; 8-bit moments are 2 bytes + two fp32 scales per 2048 only
    # in leaves of 4096 elements or more that are not embeddings: none here (the largest, the embeddings, is 800),
    # so the engine keeps every moment at 32 bits; a bf16 reduction adds its send buffers
    plan = zero_estimate(CFG, 2, 2, 1, 16, "every", state_bits=8, exact_skip=True, reduce_bytes=2)
    assert (plan.masters, plan.moments) == (2 * 1344 * 4, 2 * 1344 * 8)
    assert plan.gradients == 2688 * 4 + 1344 * 4 + 2688 * 2 + 1344 * 2


def zero3_held(world: int) -> list[tuple[int, int, int, int]]:
    """This rank's ZeRO-3 trainer at rest (``--states gpu``, bf16, after a step), its weights released and held: the
    bytes its tensors hold, its shards' elements with their padding (``buckets.plan_buckets``) and without (its
    optimizer's pieces), its units."""
    import torch
    import torch.distributed as dist

    from nanotrain.core.models import init_params
    from nanotrain.core.optim import AdamConfig, OffloadConfig
    from nanotrain.core.train.resident import TrainConfig
    from nanotrain.data_parallel import DPConfig
    from nanotrain.data_parallel.trainer import data_parallel_trainer
    from nanotrain.distributed import GridConfig, close_distributed, init_distributed
    from tests.plan.test_engine_bytes import held_bytes

    ctx, out = init_distributed(GridConfig(dp=world), "gloo", timeout_s=60), []
    with ctx.guard():
        for hold in (False, True):
            ocfg = OffloadConfig(device="cpu", dtype=torch.bfloat16, offload=False)
            trainer = data_parallel_trainer(CFG, init_params(CFG, 0), TrainConfig(2 * world, 1, "none"), AdamConfig(),
                                            ocfg, DPConfig(zero=3, hold=hold), dist.group.WORLD)
            tokens = torch.randint(0, CFG.vocab_size, (2 * world, 16), generator=torch.Generator().manual_seed(0))
            trainer.step(tokens, tokens.roll(-1, 1))
            held = held_bytes(trainer)
            shard = sum(b.shard for b in trainer.inner.weights.buckets)  # padded, as the engine lays it out
            real = sum(p.hi - p.lo for pieces in trainer.opt.pieces.values() for p in pieces)  # the optimizer's
            out.append((held, shard, real, len(trainer.inner.weights.buckets)))
            trainer.close()
    close_distributed(ctx)
    return out


def test_zero3_holds_at_rest_what_its_estimate_counts():
    """Between steps a ZeRO-3 rank holds what the estimate counts as outliving a step: its shard in bf16 (the weights
    its optimizer updates, in the gather's input: padded), the fp32 gradient shard it accumulates (padded),
    fp32 masters and 32-bit moments (its pieces), two fp32 scalars (the anchor the embeddings' segment starts
    autograd from, the loss scale's reciprocal) and an int64 index per unit and rank (where a non-finite sum is
    spread to); the gathered units and the gradients being reduced are gone (their
    memory released). Three ranks: 2688 does not split evenly, so the byte count is the estimate's per-rank
    n / 3 within the padding each unit takes to a multiple of 3 (the last rank's shard holds it). Held
    (``DPConfig.hold``), the whole model's bf16 weights stay, the shard a slice of them: n in bf16 for the shard's."""
    from nanotrain.distributed import spawn

    plan, held_plan = (zero_estimate(CFG, 3, 3, 1, 16, "none", states_on_gpu=True, hold=h) for h in (False, True))
    shard = 2688 // 3
    assert (plan.masters, plan.moments) == (4 * shard, 8 * shard)
    assert held_plan.weights == 2688 * 2  # the weights whole, the shard among them: 2 bytes a parameter
    at_rest = shard * 2 + shard * 4 + plan.masters + plan.moments  # the estimate's parts that outlive a step
    for (held, padded, real, units), (kept, *_) in spawn(zero3_held, 3, (3,), start_method="fork", timeout_s=60):
        small = 2 * 4 + units * 3 * 8
        assert held == padded * (2 + 4) + real * (4 + 8) + small, (held, padded, real)
        assert abs(held - small - at_rest) <= (padded - shard) * (2 + 4) + abs(real - shard) * (4 + 8)
        assert kept == held + 2 * padded * 2, (kept, held)  # the other two ranks' shards beside this one's
        assert abs(kept - small - (at_rest + (2688 - shard) * 2)) <= 3 * (padded - shard) * (2 + 4) + abs(
            real - shard) * (4 + 8)


def test_the_search_picks_the_stage_that_fits_and_names_it_when_a_pinned_one_does_not():
    """Each rank's footprint at each stage, searched (``nanotrain.plan``): gpt2-xl over 2 GPUs of 12 GiB, masters and
    moments in host memory, no tensor or pipeline parallelism, fits the resident engines only as ZeRO-3 recomputing
    every unit, at the largest micro-batch that fits (ZeRO-Offload, weighed since no layout holds the state on the
    GPUs, streams it faster); DDP without recompute pinned is refused, naming the recompute that fits. (12 GiB: at 11,
    where this ran before each rank kept ``COLLECTIVE_BYTES`` free for NCCL, DDP fits no longer at all.)"""
    xl, h100 = preset("gpt2-xl"), GPUS["H100"]
    box = Box(2, 12 * GIB, None, h100.costs(), h100.peer_bytes_s)
    pins = Pins(states="cpu", tp=1, pp=1, gpus=2)  # over both GPUs
    plans = search(Ask(xl, 64, 1024, pins=pins), box)
    pick = next(q for q in plans if q.engine == "data-parallel")
    assert (pick.engine, pick.zero, pick.recompute, pick.micro_batch) == ("data-parallel", 3, "every", 16)
    assert (plans[0].engine, plans[0].world) == ("streamed", 2) and plans[0].step_s < pick.step_s
    with pytest.raises(MemoryError, match=r"leaving out --recompute none \(planned: --micro-batch 2 --states cpu "
                                          r"--recompute every --dp 2\)"):
        search(Ask(xl, 64, 1024, pins=replace(pins, zero=0, recompute="none")), box)


def test_finetune_refuses_before_loading_anything(tmp_path, monkeypatch):
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=r"^error: no plan of 64 x 1024 fits 4 GPUs of 11.0 GiB with the settings "
                                         r"given; "
                                         r"the least that works: .*leaving out --zero 1 \(planned: .*--recompute every "
                                         r"--dp 4 --zero 3\)"):
        main(["--model", "gpt2-xl", "--dp", "4", "--zero", "1", "--gpu-mem-gib", "11", "--dtype", "bf16",
              "--data", "no-such-file.txt", "--out", "run"])
    assert not (tmp_path / "run").exists()
