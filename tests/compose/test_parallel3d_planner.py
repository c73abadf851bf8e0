"""The 3D planner's arithmetic, term by term, on layouts whose answer is known in closed form; its memory
model against what the engine allocates (counted on the CPU)."""
from __future__ import annotations

import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from nanotrain.data_parallel import DPConfig
from nanotrain.core.models import model_spec, preset
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, spawn
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.optim.quant8 import dynamic_code
from nanotrain.compose import Parallel3DTrainer, build_3d
from nanotrain.core.machine import GIB
from nanotrain.compose.planner import (BYTES, Hardware, Layout, Training, head_bytes, layouts,
                                          peak_in_flight, plan, predict, ring_all_reduce_s, stage_params)
from nanotrain.pipeline import LayeredModel, build_schedule, partition

CFG = preset("tiny", n_layer=8, vocab_size=256, n_ctx=32)  # 64 wide, 4 heads
N = model_spec(CFG).costs.total_params
SEQ = 32
HW = Hardware(n_gpus=8, mem_bytes=80 * GIB, flops=1e12, tp_bandwidth=1e11, link_bandwidth=1e10, reserve_bytes=0)


def fwd_flops_per_token() -> float:
    c = CFG.n_embd
    return CFG.n_layer * (24 * c * c + 4 * SEQ * c) + 2 * CFG.vocab_size * c


def test_ring_all_reduce():
    assert ring_all_reduce_s(1e9, 1, 1e9) == 0.0
    assert ring_all_reduce_s(1e9, 2, 1e9) == pytest.approx(1.0)
    assert ring_all_reduce_s(1e9, 4, 1e9) == pytest.approx(1.5)


def test_stage_params_add_up_to_the_model():
    whole = partition(LayeredModel.from_spec(CFG, SEQ), 1)[0]
    assert stage_params(CFG, whole, 1) == N
    specs = partition(LayeredModel.from_spec(CFG, SEQ), 4)
    # the tied wte counts on the first and the last stage; 256 rows need no padding at tp 1
    assert sum(stage_params(CFG, s, 1) for s in specs) == N + CFG.vocab_size * CFG.n_embd
    c = CFG.n_embd
    per_block_tp2 = (12 * c * c + 7 * c) / 2 + 6 * c  # sharded matrices and column biases, replicated rest
    assert stage_params(CFG, specs[1], 2) == len(specs[1].layers) * per_block_tp2


def test_one_gpu_is_compute_only():
    lay = Layout(1, 1, 1, micro_batch=4, n_micro=2, schedule="1f1b", recompute=False)
    q = predict(CFG, SEQ, lay, Hardware(1, 80 * GIB, 1e12, 1e11, 1e10, reserve_bytes=0))
    assert q.step_s == pytest.approx(3 * 8 * SEQ * fwd_flops_per_token() / 1e12)  # F + 2F per token
    assert (q.comm_s, q.dp_s, q.bubble) == (0.0, 0.0, pytest.approx(0.0))
    acts = 4 * SEQ * CFG.n_layer * 16 * CFG.n_embd * BYTES  # one micro-batch in flight, 4C + 12C values per token
    head = head_bytes(CFG, 4 * SEQ, 1)  # the one stage holds the head: the loss's chunk of logits and gradients
    assert q.mem_bytes == pytest.approx(20 * N + acts + head)  # gradient, weight, master: 4 each; moments 8
    redo = predict(CFG, SEQ, Layout(1, 1, 1, 4, 2, "1f1b", True), Hardware(1, 80 * GIB, 1e12, 1e11, 1e10,
                                                                         reserve_bytes=0))
    assert redo.step_s == pytest.approx(q.step_s * 4 / 3)  # one more forward of the blocks, head included
    assert redo.mem_bytes == pytest.approx(20 * N + acts / 16 + head)  # the block inputs only


def test_data_parallel_adds_the_gradient_all_reduce():
    one = predict(CFG, SEQ, Layout(1, 1, 1, 4, 2, "1f1b", False), HW)
    four = predict(CFG, SEQ, Layout(1, 1, 4, 4, 2, "1f1b", False), HW)
    assert four.dp_s == pytest.approx(ring_all_reduce_s(N * BYTES, 4, HW.link_bandwidth))
    assert four.step_s == pytest.approx(one.step_s + four.dp_s)


def test_the_data_parallel_sum_hides_under_the_cool_down():
    """Each stage's reduction starts at its last backward: with the cool-down long against the link, only
    the first rank's (whose stage finishes last, at the pipeline's end) is exposed; with a slow link, the
    reductions queue and more shows, but never more than reducing everything after the pipeline."""
    specs = partition(LayeredModel.from_spec(CFG, SEQ), 4)
    slow_compute = Hardware(8, 80 * GIB, 1e9, 1e11, 1e10, reserve_bytes=0)
    q = predict(CFG, SEQ, Layout(1, 4, 2, 1, 8, "1f1b", False), slow_compute)
    assert q.dp_s == pytest.approx(ring_all_reduce_s(stage_params(CFG, specs[0], 1) * BYTES, 2, 1e10))
    assert q.step_s == pytest.approx(q.dp_s + predict(CFG, SEQ, Layout(1, 4, 1, 1, 8, "1f1b", False),
                                                      slow_compute).step_s)
    slow_link = Hardware(8, 80 * GIB, 1e12, 1e11, 1e7, reserve_bytes=0)
    q = predict(CFG, SEQ, Layout(1, 4, 2, 1, 8, "interleaved-1f1b", False), slow_link)
    specs = partition(LayeredModel.from_spec(CFG, SEQ), 8)  # rank 0 holds stages 0 and 4
    first, fifth = (ring_all_reduce_s(stage_params(CFG, specs[s], 1) * BYTES, 2, 1e7) for s in (0, 4))
    assert first < q.dp_s <= first + fifth


def test_pipeline_bubble_and_in_flight_micro_batches():
    q = predict(CFG, SEQ, Layout(1, 4, 1, 1, 8, "1f1b", False), Hardware(4, 80 * GIB, 1e12, 1e11, 1e30,
                                                                        reserve_bytes=0))
    # stages are not equal (the head sits on the last), so at least the equal-stage bubble (p-1)/(m+p-1)
    assert q.bubble >= 3 / 11 - 1e-9
    s = build_schedule("1f1b", 4, 8)
    held = {i: 1.0 for i in range(4)}
    assert [peak_in_flight(s, r, held) for r in range(4)] == [4, 3, 2, 1]
    assert peak_in_flight(build_schedule("gpipe", 4, 8), 0, held) == 8


def test_tensor_parallel_splits_compute_and_pays_collectives():
    one = predict(CFG, SEQ, Layout(1, 1, 1, 4, 2, "1f1b", False), Hardware(1, 80 * GIB, 1e12, 1e11, 1e10))
    two = predict(CFG, SEQ, Layout(2, 1, 1, 4, 2, "1f1b", False), Hardware(2, 80 * GIB, 1e12, 1e11, 1e10))
    assert two.compute_s == pytest.approx(one.compute_s / 2)
    per = ring_all_reduce_s(4 * SEQ * CFG.n_embd * BYTES, 2, 1e11)
    # per micro-batch: 2 per block + embedding + head, in forward and again in backward
    assert two.comm_s == pytest.approx(2 * 2 * (2 * CFG.n_layer + 2) * per)


def test_layouts_respect_the_engine_and_the_pick_fits():
    all_ = layouts(CFG, HW, global_batch=16)
    assert all(lay.tp * lay.pp * lay.dp == 8 and lay.tp <= CFG.n_head for lay in all_)
    assert all(16 % lay.dp == 0 and lay.micro_batch * lay.n_micro * lay.dp == 16 for lay in all_)
    assert all(lay.n_micro % lay.pp == 0 for lay in all_ if lay.schedule == "interleaved-1f1b")
    tight = Hardware(8, 0.002 * GIB, 1e12, 1e11, 1e10, reserve_bytes=0)
    preds = plan(CFG, SEQ, tight, 16)
    assert any(q.fits for q in preds) and any(not q.fits for q in preds)
    fit = [q for q in preds if q.fits]
    assert preds[0] is fit[0] and preds[0].step_s == min(q.step_s for q in fit)
    with pytest.raises(ValueError, match="no layout"):
        plan(CFG, SEQ, Hardware(16, GIB, 1e12, 1e11, 1e10, gpus_per_node=1), 3)  # pp <= 8: dp >= 2


def test_memory_counts_bf16_8bit_moments_and_zero():
    """Per parameter held: DDP 4 + w + 4 + m; ZeRO-1 4 + w + (w + 4 + m) / dp, ZeRO-2 4 / dp more; offload
    keeps 4 + m on the host. The activations in the compute dtype."""
    hw = Hardware(2, 80 * GIB, 1e12, 1e11, 1e10, reserve_bytes=0)
    n, acts = N, 4 * SEQ * CFG.n_layer * 16 * CFG.n_embd  # values of one micro-batch in flight
    bf16_8bit = Training(compute_bytes=2, moment_bits=8, block=64)
    m8 = 2 + 2 * 4 / 64  # two uint8 moments and an fp32 absmax per 64 values for each
    cases = [  # (layout's dp and zero, training, bytes per parameter, bytes per activation value)
        (1, 0, Training(), 4 + 4 + 4 + 8, 4),
        (1, 0, Training(moment_bits=8, block=64), 4 + 4 + 4 + m8, 4),
        (2, 0, bf16_8bit, 4 + 2 + 4 + m8, 2),
        (2, 1, bf16_8bit, 4 + 2 + (2 + 4 + m8) / 2, 2),
        (2, 2, bf16_8bit, 4 + 2 + (2 + 4 + m8 + 4) / 2, 2),
        (2, 1, Training(), 4 + 4 + (4 + 4 + 8) / 2, 4),
        (2, 2, Training(compute_bytes=2, offload=True), 4 + 2 + (2 + 4) / 2, 2),
    ]
    for dp, zero, training, per_param, per_value in cases:
        q = predict(CFG, SEQ, Layout(1, 1, dp, 4, 2, "1f1b", False, zero), hw, training)
        head = head_bytes(CFG, 4 * SEQ, 1, training.compute_bytes)
        assert q.mem_bytes == pytest.approx(n * per_param + acts * per_value + head), (dp, zero, training)


def test_zero_exposes_its_all_gather_and_is_picked_where_it_moves_less_or_only_it_fits():
    hw = Hardware(4, 80 * GIB, 1e12, 1e11, 1e10, reserve_bytes=0)
    bf16 = Training(compute_bytes=2)
    ddp, one, two = (predict(CFG, SEQ, Layout(1, 1, 4, 4, 1, "1f1b", False, z), hw, bf16) for z in (0, 1, 2))
    # one stage: nothing hides; fp32 gradients are summed (DDP, ZeRO-1) or reduce-scattered (ZeRO-2), the new
    # bf16 weights all-gathered (ZeRO)
    summed, gathered = ring_all_reduce_s(N * 4, 4, 1e10), ring_all_reduce_s(N * 2, 4, 1e10) / 2
    assert (ddp.dp_s, one.dp_s, two.dp_s) == pytest.approx((summed, summed + gathered, summed / 2 + gathered))
    # interleaved: rank 0's second stage finishes early, and DDP hides its sum under the cool-down; ZeRO-1's
    # sum hides as well, but its all-gather of the new weights comes after the step's pipeline
    slow = Hardware(4, 80 * GIB, 1e9, 1e11, 1e10)
    inter = [predict(CFG, SEQ, Layout(1, 2, 2, 1, 8, "interleaved-1f1b", False, z), slow, bf16) for z in (0, 1)]
    specs = partition(LayeredModel.from_spec(CFG, SEQ), 4)
    hidden = ring_all_reduce_s(stage_params(CFG, specs[2], 1) * 2, 2, 1e10)
    assert inter[1].dp_s >= inter[0].dp_s + hidden / 2 - 1e-12
    need = {z: min(q.mem_bytes for q in plan(CFG, SEQ, hw, 16, bf16) if q.layout.zero == z and q.layout.dp == 4)
            for z in (0, 1, 2)}
    assert need[1] < need[2] < need[0]
    tight = Hardware(4, (need[0] + need[2]) / 2, 1e12, 1e11, 1e10, reserve_bytes=0)
    preds = plan(CFG, SEQ, tight, 16, bf16)
    assert preds[0].fits
    assert any(q.layout.zero for q in preds if q.fits and q.layout.dp == 4)  # only ZeRO fits at dp 4
    assert not any(q.fits for q in preds if q.layout.dp == 4 and not q.layout.zero)


def _held_bytes() -> dict[int, int]:
    """Every CPU tensor storage Python can reach, by address: what a rank holds, counted from outside. Tensors
    without storage (fake tensors a compile in this process left behind, forked into the rank) hold nothing."""
    out = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu" and not isinstance(o, FakeTensor):
            out[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
    return out


def engine_worker(dp: int) -> list[tuple[str, float, float]]:
    """Build a dp-only 3D model and its trainer for each training; the bytes they added against the model's count."""
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=dp), "gloo", timeout_s=60)
    cfg, out = preset("tiny", n_layer=2, vocab_size=256, n_ctx=32), []
    dynamic_code(True, torch.device("cpu")), dynamic_code(False, torch.device("cpu"))  # made once per process
    with ctx.guard():
        for dtype, bits, zero in ((torch.float32, 32, 1), (torch.bfloat16, 8, 0), (torch.bfloat16, 8, 1),
                                  (torch.bfloat16, 32, 0), (torch.float32, 32, 2), (torch.bfloat16, 8, 2)):
            gc.collect()
            before = _held_bytes()
            p3d = build_3d(ctx, cfg, build_schedule("1f1b", 1, 2), 16, 2, dtype=dtype)
            opt = Parallel3DTrainer(p3d, AdamConfig(), OffloadConfig(device="cpu", dtype=dtype, offload=False,
                                                                     state_bits=bits, block=64, min_8bit_numel=256),
                                    DPConfig(zero=zero))
            gc.collect()
            added = sum(n for ptr, n in _held_bytes().items() if ptr not in before)
            training = Training(2 if dtype == torch.bfloat16 else 4, bits, block=64)
            out.append((f"{dtype} {bits}-bit zero {zero}", added,
                        training.param_bytes(zero, ctx.grid.dp) * model_spec(cfg).costs.total_params))
            del p3d, opt
    close_distributed(ctx)
    return out


@pytest.mark.parametrize("dp", [2, 3])
def test_memory_model_counts_what_the_engine_allocates(dp):
    """On the CPU every byte is a tensor Python reaches: what building the model and its trainer adds on a rank is
    the model's count, up to the buckets' padding and the leaves too small for 8 bits (LayerNorms, 32-bit)."""
    for rank in spawn(engine_worker, dp, (dp,), timeout_s=60, start_method="fork"):
        for name, added, counted in rank:
            assert abs(added - counted) <= 0.01 * counted, f"dp {dp}, {name}: holds {added} bytes, counted {counted}"


def test_the_per_layer_overhead_favours_fewer_micro_batches_and_reaches_the_task(monkeypatch, capsys):
    """Fitted to gpt2-xl on an H200 (docs/BENCHMARKS.md): with a per-layer cost, 16 micro-batches of 1
    no longer tie with 4 of 4; ``tasks.finetune --plan auto --layer-overhead-ms`` hands it to the planner."""
    cfg, one = preset("gpt2-xl"), Layout(1, 1, 1, 1, 16, "1f1b", False, 0)
    four = Layout(1, 1, 1, 4, 4, "1f1b", False, 0)
    free, costly = (Hardware(1, 139 * GIB, 5e14, 1e11, 1e11, layer_overhead_s=o) for o in (0.0, 1.5e-4))
    assert predict(cfg, 1024, one, free).step_s == pytest.approx(predict(cfg, 1024, four, free).step_s)
    assert predict(cfg, 1024, one, costly).step_s > 1.3 * predict(cfg, 1024, four, costly).step_s
    from nanotrain.compose import planner as planner_3d  # imported by the search where a layout may use it
    from nanotrain.run import compose
    from nanotrain.run.flags import freeze, parse_args

    seen = []
    monkeypatch.setattr(planner_3d, "plan", lambda cfg, seq, hw, *a: seen.append(hw) or plan(cfg, seq, hw, *a))
    args = freeze(parse_args(["--plan", "auto", "--gpus", "2", "--layer-overhead-ms", "0.15", "--model", "tiny",
                              "--batch", "16", "--seq", "64"]))
    args, pins, _ = compose.plan_layout(args, frozenset({"model", "batch", "seq", "plan", "gpus"}), preset("tiny"),
                                        torch.device("cpu"), True)
    assert seen[0].layer_overhead_s == pytest.approx(1.5e-4) and seen[0].n_gpus == 2
    assert args.tp * args.pp * args.dp == 2 and {"dp", "tp", "pp", "micro_batch", "states", "recompute"} <= pins
    out = capsys.readouterr().out
    assert out.startswith("plans by predicted step time") and f"--dp {args.dp}" in out.splitlines()[-1]


def test_plan_auto_refuses_a_cap_no_layout_meets_naming_the_smallest(capsys):
    """``--plan auto`` under a cap no layout fits: one line naming the least GPU memory that works (the layout that
    needs least, in the 3D planner's count), before anything loads."""
    from nanotrain.run import compose
    from nanotrain.run.flags import freeze, parse_args

    args = freeze(parse_args(["--plan", "auto", "--gpus", "2", "--gpu-mem-gib", "0.001", "--model", "gpt2",
                              "--batch", "8", "--seq", "64"]))
    preds = plan(preset("gpt2"), 64, Hardware(2, 0.001 * GIB, 2e10, 1e11, 1e11), 8, Training(4, args.adam_bits, False))
    least = min(q.mem_bytes for q in preds if q.layout.tp * q.layout.pp > 1)
    with pytest.raises(SystemExit):
        compose.plan_layout(args, frozenset({"model", "batch", "seq"}), preset("gpt2"), torch.device("cpu"), True)
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no plan of 8 x 64 fits 2 GPUs of 0.0 GiB with the settings given") and "\n" not in err
    named = float(err.split("--gpu-mem-gib ")[1].split()[0].rstrip(";")) * GIB
    assert named <= least + 0.1 * GIB  # the least of every engine's, the 3D layouts' among them
