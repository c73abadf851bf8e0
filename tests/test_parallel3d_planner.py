"""The 3D planner's arithmetic, term by term, on layouts whose answer is known in closed form."""
from __future__ import annotations

import pytest

from nanotrain.config import GPT2Config
from nanotrain.parallel3d.planner import (BYTES, GIB, Hardware, Layout, format_plan, layouts, peak_in_flight, plan,
                                          predict, ring_all_reduce_s, stage_params)
from nanotrain.pipeline import build_schedule, gpt2_layered, partition

CFG = GPT2Config(n_layer=8, n_embd=64, n_head=4, vocab_size=256, n_ctx=32)
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
    whole = partition(gpt2_layered(CFG, SEQ), 1)[0]
    assert stage_params(CFG, whole, 1) == CFG.num_params()
    specs = partition(gpt2_layered(CFG, SEQ), 4)
    # the tied wte counts on the first and the last stage; 256 rows need no padding at tp 1
    assert sum(stage_params(CFG, s, 1) for s in specs) == CFG.num_params() + CFG.vocab_size * CFG.n_embd
    c = CFG.n_embd
    per_block_tp2 = (12 * c * c + 7 * c) / 2 + 6 * c  # sharded matrices and column biases, replicated rest
    assert stage_params(CFG, specs[1], 2) == len(specs[1].layers) * per_block_tp2


def test_one_gpu_is_compute_only():
    lay = Layout(1, 1, 1, micro_batch=4, n_micro=2, schedule="1f1b", recompute=False)
    q = predict(CFG, SEQ, lay, Hardware(1, 80 * GIB, 1e12, 1e11, 1e10, reserve_bytes=0))
    assert q.step_s == pytest.approx(3 * 8 * SEQ * fwd_flops_per_token() / 1e12)  # F + 2F per token
    assert (q.comm_s, q.dp_s, q.bubble) == (0.0, 0.0, pytest.approx(0.0))
    acts = 4 * SEQ * CFG.n_layer * 16 * CFG.n_embd * BYTES  # one micro-batch in flight, 4C + 12C values per token
    assert q.mem_bytes == pytest.approx(16 * CFG.num_params() + acts)
    redo = predict(CFG, SEQ, Layout(1, 1, 1, 4, 2, "1f1b", True), Hardware(1, 80 * GIB, 1e12, 1e11, 1e10,
                                                                         reserve_bytes=0))
    assert redo.step_s == pytest.approx(q.step_s * 4 / 3)  # one more forward of the blocks, head included
    assert redo.mem_bytes == pytest.approx(16 * CFG.num_params() + acts / 16)  # the block inputs only


def test_data_parallel_adds_the_gradient_all_reduce():
    one = predict(CFG, SEQ, Layout(1, 1, 1, 4, 2, "1f1b", False), HW)
    four = predict(CFG, SEQ, Layout(1, 1, 4, 4, 2, "1f1b", False), HW)
    assert four.dp_s == pytest.approx(ring_all_reduce_s(CFG.num_params() * BYTES, 4, HW.link_bandwidth))
    assert four.step_s == pytest.approx(one.step_s + four.dp_s)


def test_the_data_parallel_sum_hides_under_the_cool_down():
    """Each stage's reduction starts at its last backward: with the cool-down long against the link, only
    the first rank's (whose stage finishes last, at the pipeline's end) is exposed; with a slow link, the
    reductions queue and more shows, but never more than reducing everything after the pipeline."""
    specs = partition(gpt2_layered(CFG, SEQ), 4)
    slow_compute = Hardware(8, 80 * GIB, 1e9, 1e11, 1e10, reserve_bytes=0)
    q = predict(CFG, SEQ, Layout(1, 4, 2, 1, 8, "1f1b", False), slow_compute)
    assert q.dp_s == pytest.approx(ring_all_reduce_s(stage_params(CFG, specs[0], 1) * BYTES, 2, 1e10))
    assert q.step_s == pytest.approx(q.dp_s + predict(CFG, SEQ, Layout(1, 4, 1, 1, 8, "1f1b", False),
                                                      slow_compute).step_s)
    slow_link = Hardware(8, 80 * GIB, 1e12, 1e11, 1e7, reserve_bytes=0)
    q = predict(CFG, SEQ, Layout(1, 4, 2, 1, 8, "interleaved-1f1b", False), slow_link)
    specs = partition(gpt2_layered(CFG, SEQ), 8)  # rank 0 holds stages 0 and 4
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
    assert "layouts fit" in format_plan(preds, SEQ, 16)
    with pytest.raises(ValueError, match="no layout"):
        plan(CFG, SEQ, Hardware(16, GIB, 1e12, 1e11, 1e10, gpus_per_node=1), 3)  # pp <= 8: dp >= 2
