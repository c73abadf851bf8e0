"""The one search: the fastest predicted plan among those that fit, pins honoured, masters and moments on the GPU
wherever they fit, a cap no plan meets refused naming what would."""
from __future__ import annotations

from dataclasses import replace

import pytest

from nanotrain.core.footprint import HOST_ADAM_PARAMS_S, fits, resident_step_s
from nanotrain.core.machine import CUDA_RUNTIME_BYTES, GIB
from nanotrain.core.models import model_spec, preset
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.plan.candidates import Ask, Box, Pins, resident, streamed
from nanotrain.plan.composed import composed
from nanotrain.plan.plan import Plan
from nanotrain.plan.report import Machine, plan_table
from nanotrain.plan.search import search
from nanotrain.stream.search import GPUS

H100 = GPUS["H100"]


def box(gpus: int = 1, gpu_gib: float = H100.memory_gib, host_gib: float | None = None) -> Box:
    return Box(gpus, int(gpu_gib * GIB), None if host_gib is None else int(host_gib * GIB), H100.costs(),
               H100.peer_bytes_s)


def test_the_plain_1b_command_keeps_masters_and_moments_on_an_80_gb_card():
    """Issue 37's first row: llama-3.2-1b at batch 32 on one H100 ran 13% MFU with its state in host memory and 50%
    with it on the GPU; the plan with nothing pinned must be the second."""
    plan = search(Ask(preset("llama-3.2-1b"), 32, 1024), box())[0]
    assert (plan.engine, plan.states) == ("resident", "gpu") and plan.gpu_bytes <= box().gpu_cap
    spread = search(Ask(preset("llama-3.2-1b"), 128, 1024), box(gpus=4))[0]
    assert (spread.engine, spread.states, spread.dp) == ("data-parallel", "gpu", 4)


def test_the_host_update_is_what_issue_37_measured():
    """The fitted rate reproduces its table: 2.0 s a step with the state in host memory, compute-bound on the GPU."""
    cfg, policy = preset("llama-3.2-1b"), RecomputePolicy.parse("none")
    n = model_spec(cfg).costs.total_params
    host = resident_step_s(cfg, 32, 1024, 8, policy, H100.costs().flops, H100.costs().pass_overhead_s, n)
    on_gpu = resident_step_s(cfg, 32, 1024, 8, policy, H100.costs().flops, H100.costs().pass_overhead_s)
    assert host == pytest.approx(n / HOST_ADAM_PARAMS_S) and host == pytest.approx(2.07, abs=0.05)
    assert on_gpu == pytest.approx(0.52, abs=0.03)


@pytest.mark.parametrize("model, batch, gpus, gpu_gib, host_gib", [
    ("llama-3.2-1b", 32, 1, 40, None), ("gpt2-large", 32, 1, 16, 32), ("llama-3.1-8b", 32, 1, 24, 96),
    ("llama-3.2-1b", 64, 2, 24, None)])
def test_the_pick_is_the_fastest_predicted_of_every_plan_that_fits(model, batch, gpus, gpu_gib, host_gib):
    """Every engine's plans on every GPU count the machine offers (1 to its own: the count is planned too), streaming
    over several GPUs where no layout at that count holds masters and moments on the GPUs (``search.ranked``)."""
    ask, machine = Ask(preset(model), batch, 1024), box(gpus, gpu_gib, host_gib)
    plans = search(ask, machine)
    every = []
    for n in range(1, gpus + 1):
        here = [q for engine in (resident, composed) for q in engine(ask, replace(machine, gpus=n))]
        offload = n == 1 or not any(q.states == "gpu" for q in here)
        every += here + (list(streamed(ask, replace(machine, gpus=n))) if offload else [])
    assert len(plans) == len(every) and plans[0].step_s == min(q.step_s for q in every)
    assert [round(q.step_s, 6) for q in plans] == sorted(round(q.step_s, 6) for q in plans)  # ties: least memory
    for q in plans:  # every engine's allocated peak leaves the one margin free; every plan has a host model
        assert fits(q.gpu_bytes, machine.gpu_cap, machine.expandable, q.world)
        assert q.host_bytes is not None and (host_gib is None or q.host_bytes <= machine.host_cap)


@pytest.mark.parametrize("pins, check", [
    (Pins(states="cpu"), lambda q: q.states == "cpu"),
    (Pins(recompute="every"), lambda q: q.recompute == "every" or q.engine == "streamed"),
    (Pins(micro_batch=4), lambda q: q.micro_batch == 4),
    (Pins(zero=2), lambda q: q.zero == 2 and q.engine == "data-parallel"),
    (Pins(stream=True), lambda q: q.engine == "streamed"),
    (Pins(tp=2), lambda q: q.engine == "3d" and q.tp == 2),
    (Pins(pp=2, schedule="1f1b"), lambda q: q.engine == "3d" and q.pp == 2 and q.schedule == "1f1b"),
])
def test_a_pinned_setting_is_never_traded_away(pins, check):
    gpus = 1 if pins.stream or pins.micro_batch else 2
    plans = search(Ask(preset("gpt2-medium"), 16, 1024, pins=pins), box(gpus, 40, 64))
    assert plans and all(check(q) for q in plans)


def test_a_3d_rank_s_host_is_counted_and_a_host_cap_below_it_refuses_the_layout():
    """A 3D rank holds the process, CUDA's libraries and, with its states on the host, its TP x PP (x ZeRO) share of
    the masters and moments: a cap under that leaves no 3D plan with those states."""
    ask = Ask(preset("gpt2-medium"), 16, 1024, pins=Pins(tp=2, pp=2, states="cpu"))
    plans = search(ask, box(4, 40))
    assert plans and all(q.engine == "3d" and q.host_bytes > CUDA_RUNTIME_BYTES for q in plans)
    least = min(q.host_bytes for q in plans)
    with pytest.raises(MemoryError):
        search(ask, box(4, 40, (least - 1) / GIB))


def test_compiled_blocks_are_planned_without_recompute():
    """The resident trainer compiles only blocks it does not recompute; the 3D trainer compiles any block."""
    plans = search(Ask(preset("gpt2-large"), 32, 1024, compile=True), box(2, 24))
    assert {q.recompute for q in plans if q.engine in ("resident", "data-parallel")} == {"none"}
    assert any(q.engine == "3d" and q.recompute == "every" for q in plans)


def test_a_cap_no_plan_meets_names_the_least_caps_gpus_or_pin_that_work():
    with pytest.raises(MemoryError) as e:
        search(Ask(preset("llama-3.1-8b"), 32, 1024, pins=Pins(states="gpu")), box(1, 40))
    msg = str(e.value)
    assert msg.startswith("no plan of 32 x 1024 fits 1 GPU of 40.0 GiB with the settings given")
    assert "--gpu-mem-gib 1" in msg and "GPUs" in msg and "leaving out --states gpu (planned:" in msg
    least = float(msg.split("--gpu-mem-gib ")[1].split()[0])
    assert search(Ask(preset("llama-3.1-8b"), 32, 1024, pins=Pins(states="gpu")), box(1, least))  # it does fit
    with pytest.raises(MemoryError):
        search(Ask(preset("llama-3.1-8b"), 32, 1024, pins=Pins(states="gpu")), box(1, least - 0.2))
    # on a card that has less than that cap, no cap can reach it: the refusal names what can
    for card_gib, named in ((H100.memory_gib, False), (least + 1, True)):
        with pytest.raises(MemoryError) as e:
            search(Ask(preset("llama-3.1-8b"), 32, 1024, pins=Pins(states="gpu")),
                   replace(box(1, 40), card_bytes=int(card_gib * GIB)))
        assert ("--gpu-mem-gib" in str(e.value)) == named and "GPUs or leaving out --states gpu" in str(e.value)


def test_the_plain_finetune_command_plans_the_state_onto_the_gpu_and_says_so(capsys):
    """``tasks.finetune``'s side: its flags, with only what was given pinned, through the same search; the pick
    printed with the flags that pin it. Here: llama-3.2-1b at batch 32 on one 80 GB card, nothing but the batch
    given, then ``--states cpu`` given."""
    from nanotrain.plan.run import pick
    from nanotrain.run.flags import freeze, parse_args

    cfg = preset("llama-3.2-1b")
    args = freeze(parse_args(["--model", "llama-3.2-1b", "--batch", "32"]))
    plan = pick(args, frozenset({"model", "batch"}), cfg, box(), "NVIDIA H100 80GB HBM3", "allocator: ...")
    out = capsys.readouterr().out
    assert (plan.engine, plan.states) == ("resident", "gpu")
    assert f"plan: resident (one GPU): micro-batch {plan.micro_batch}, masters and moments on the gpu" in out
    assert "--states gpu" in out.splitlines()[-1]
    args = freeze(parse_args(["--model", "llama-3.2-1b", "--batch", "32", "--states", "cpu"]))
    pinned = pick(args, frozenset({"model", "batch", "states"}), cfg, box(), "H100", "allocator: ...")
    # With the state in host memory, streaming it through the GPU's update beats the host's AdamW (2 s a step).
    assert (pinned.states, pinned.engine) == ("cpu", "streamed") and plan.step_s < pinned.step_s < 1.0


def test_the_gpu_count_is_planned_and_more_gpus_are_taken_only_where_predicted_faster():
    """On a machine of 4 GPUs the count is part of what the search ranks (1 to 4): llama-3.2-1b at batch 128 is
    fastest data-parallel over all 4; gpt2 at 8 x 128 on one GPU, every plan over more predicted slower; a count
    given (``Pins.gpus``, ``--gpus 4``) is taken whole even so."""
    spread = search(Ask(preset("llama-3.2-1b"), 128, 1024), box(gpus=4))
    assert (spread[0].engine, spread[0].world) == ("data-parallel", 4)
    one = min(q.step_s for q in spread if q.world == 1)
    assert spread[0].step_s < one / 3  # 4 ranks of a quarter of the batch, the gradients' reduction overlapped
    small = search(Ask(preset("gpt2"), 8, 128), box(gpus=4))
    assert small[0].world == 1 and all(q.step_s >= small[0].step_s for q in small if q.world > 1)
    pinned = search(Ask(preset("gpt2"), 8, 128, pins=Pins(gpus=4)), box(gpus=4))
    assert {q.world for q in pinned} == {4} and pinned[0].step_s > small[0].step_s


def test_zero3_plans_compiled_blocks_and_by_default_still_recomputes_eagerly_where_tight():
    """ZeRO-3 keeps activations under compiled blocks (its weights released under the graph): llama-3.1-8b on four
    80 GB cards plans it without recompute. Compiled blocks by default (not given) leave ZeRO-3 recomputing every
    unit eagerly open, its least memory, which a 56 GiB cap needs (there a compiled 4-stage pipeline, which keeps
    its activations, is predicted faster still); no other plan recomputes (it would run eager); compiling given,
    none recomputes."""
    plans = search(Ask(preset("llama-3.1-8b"), 64, 1024, compile=None), box(4, 78.6))
    assert (plans[0].engine, plans[0].zero, plans[0].recompute, plans[0].dp) == ("data-parallel", 3, "none", 4)
    # its masters and moments fit the GPUs: ZeRO-Offload over several (unmeasured against its prediction) not weighed
    assert all(q.world == 1 for q in plans if q.engine == "streamed")
    assert all(q.recompute == "none" for q in plans if q.engine in ("resident", "data-parallel") and q.zero != 3)
    tight = search(Ask(preset("llama-3.1-8b"), 64, 1024, compile=None), box(4, 56))
    assert (tight[0].engine, tight[0].pp, tight[0].recompute) == ("3d", 4, "none")
    zero3 = [q for q in tight if q.engine == "data-parallel"]  # fastest first
    assert (zero3[0].zero, zero3[0].recompute, zero3[0].states) == (3, "every", "gpu")  # the fastest of them
    given = search(Ask(preset("llama-3.1-8b"), 64, 1024, compile=True), box(4, 78.6))
    assert given[0].zero == 3 and all(q.recompute == "none" for q in given if q.engine in ("resident", "data-parallel"))


def test_adapters_stream_on_one_gpu_and_replicate_over_several():
    """A LoRA run streams its frozen base on one GPU only (the streamed engine's ZeRO-Offload trains whole models),
    replicates over several (DDP, ZeRO-1/2: the pairs reduced), and takes no 3D layout."""
    from nanotrain.core.models.lora import LoraConfig, with_lora
    spec = with_lora(model_spec(preset("llama-3.2-1b")), LoraConfig(16, 32.0, ("q", "v")))
    plans = search(Ask(spec, 16, 1024), box(2, 40))
    assert {q.engine for q in plans} <= {"resident", "data-parallel", "streamed"}
    assert all(q.world == 1 for q in plans if q.engine == "streamed")
    assert any(q.engine == "data-parallel" and q.zero in (0, 1, 2) for q in plans)
    assert all(q.world == 1 for q in search(Ask(spec, 16, 1024, pins=Pins(stream=True)), box(2, 40)))


def test_a_data_parallel_plan_s_host_peak_is_its_rank_s_share_of_the_load():
    """Each data-parallel rank keeps its share of each leaf as it reads it (``data_parallel.shards.take``; when the
    ranks built the whole fp32 tree first, the 8B ZeRO-3 ranks on 4 H200s peaked at 34.71 GiB of RSS each): with the
    masters and moments on the GPU the plan's host peak is the largest leaf in flight beside the CUDA libraries and
    the process, with them on the host its share of them as well (the step's host memory, its offload copies too,
    may be more); a host cap below that peak rules the plan out, the old tree's 35 GiB is not needed."""
    import math

    from nanotrain.core.footprint import leaf_moment_bytes
    from nanotrain.core.leaves import in_flight, rank_load_bytes

    cfg = preset("llama-3.1-8b")
    spec, base = model_spec(cfg), CUDA_RUNTIME_BYTES + box(gpus=4).base_rss
    pins = Pins(dp=4, zero=3, states="gpu")
    plan = search(Ask(cfg, 64, 1024, pins=pins), box(gpus=4))[0]
    largest = max(math.prod(leaf.shape) for leaf in spec.leaves)  # the embedding (and the untied head)
    assert plan.host_bytes == in_flight(largest, 2) + base
    assert plan.host_bytes < 6 * GIB
    with pytest.raises(MemoryError):
        search(Ask(cfg, 64, 1024, pins=pins), box(gpus=4, host_gib=plan.host_bytes / GIB - 0.01))
    on_host = search(Ask(cfg, 64, 1024, pins=replace(pins, states="cpu")), box(gpus=4))[0]
    share = rank_load_bytes(spec, 2, lambda p: (4 * math.prod(spec.leaf(p).shape) + leaf_moment_bytes(spec, p, 32)) / 4)
    assert share + base <= on_host.host_bytes < 34 * GIB


def test_without_a_host_cap_the_plan_s_processes_share_the_host_s_available_memory():
    """A plan over several GPUs starts a process on each, each with its share of the host: on a host of 512 GiB
    available, no plan of qwen2.5-32b asks for more than that, all its processes together; with no memory to speak
    of, nothing fits and the refusal says why. No layout there holds its masters and moments on the GPUs, so
    ZeRO-Offload over several is weighed, and over 2 it is predicted twice as fast as streaming on one."""
    from nanotrain.plan.search import on

    cfg = preset("qwen2.5-32b")
    machine = replace(box(gpus=4), node_host=512 * GIB)
    assert on(machine, 4).host_cap == 128 * GIB and on(box(gpus=4), 4).host_cap is None
    plans = search(Ask(cfg, 64, 1024), machine)
    for plan in plans:
        assert plan.host_bytes * plan.world <= 512 * GIB, plan.describe()
    assert not any(q.states == "gpu" for q in plans)
    one = min(q.step_s for q in plans if q.world == 1)
    assert (plans[0].engine, plans[0].world, plans[0].zero) == ("streamed", 2, 2) and plans[0].step_s < 0.55 * one
    table = plan_table(plans[0], Ask(cfg, 64, 1024), machine, Machine("H100", H100.costs(), H100.peak_flops), "", "q")
    speed = f"{64 / plans[0].step_s:.2f} seq/s"  # the run's, not a rank's
    assert "at batch 64 (32 a rank) x 1024" in table and f"): {speed}, " in table
    assert "no host cap (the host's 512.0 GiB available, 256.0 a process)" in table
    assert any(q.engine == "data-parallel" for q in search(Ask(cfg, 64, 1024), box(gpus=4)))  # unchecked, they were
    with pytest.raises(MemoryError, match=r"in the host's 1.0 GiB available"):
        search(Ask(cfg, 64, 1024), replace(box(gpus=4), node_host=GIB))


def test_the_least_gpu_cap_a_refusal_names_fits_in_the_host_s_available_memory():
    """Without a host cap the search counts the host's available memory; so does the least GPU cap it names (it
    named 15.8 GiB for an 8B model refused at 16 on a 64 GiB host: what fits only with more host memory; the
    host is 62 GiB here: this box has no process beside the masters)."""
    import re

    ask = Ask(preset("llama-3.1-8b"), 32, 1024, adam_bits=8, compile=True)
    machine = replace(box(1, 16), node_host=62 * GIB)
    with pytest.raises(MemoryError) as refused:
        search(ask, machine)
    cap = float(re.search(r"--gpu-mem-gib ([0-9.]+)", str(refused.value)).group(1))
    assert cap > 16 and search(ask, replace(machine, gpu_cap=int(cap * GIB)))


def test_tasks_plan_checks_a_named_host_s_memory_as_finetune_checks_its_own():
    """``tasks.plan --host-gib`` is the machine's available host memory, as ``tasks.finetune`` reads it (not checked
    unless given; a --host-mem-gib given is each process's cap instead)."""
    from tasks.plan import planned

    flags = ["--model", "tiny", "--batch", "8", "--seq", "64", "--gpus-found", "4"]
    assert planned(flags)[2].node_host is None
    assert planned(flags + ["--host-gib", "500"])[2].node_host == 500 * GIB
    assert planned(flags + ["--host-gib", "500", "--host-mem-gib", "64"])[2].node_host is None


def test_a_refused_adapted_run_is_told_the_host_cap_and_the_gpu_cap_its_streamed_plans_need():
    """A QLoRA run that only streaming fits, refused at a host cap just below its streamed plans' least: the refusal
    names that host cap at this GPU cap and a GPU cap at this host cap (it named only a resident GPU cap, 108 GiB for
    a 70B model refused at 24 and 50: the adapted streamed plans were never asked), and each one it names fits."""
    import re

    from nanotrain.core.models.lora import LoraConfig, with_lora
    targets = ("q", "k", "v", "o", "gate", "up", "down")
    ask = Ask(with_lora(model_spec(preset("llama-3.1-8b")), LoraConfig(16, 32.0, targets)), 8, 2048, base_bits=4,
              compile=True)
    plans = search(ask, box(1, 6))
    assert {q.engine for q in plans} == {"streamed"}
    least = min(q.host_bytes for q in plans)
    below = box(1, 6, host_gib=least / GIB - 0.5)
    with pytest.raises(MemoryError) as refused:
        search(ask, below)
    host = float(re.search(r"--host-mem-gib ([0-9.]+)", str(refused.value)).group(1))
    gpu = float(re.search(r"--gpu-mem-gib ([0-9.]+) at this host cap", str(refused.value)).group(1))
    assert host * GIB >= least - 0.1 * GIB and search(ask, replace(below, host_cap=int(host * GIB)))
    assert gpu > 6 and search(ask, replace(below, gpu_cap=int(gpu * GIB)))


def test_a_run_ends_saying_how_far_its_plan_was_from_what_it_measured():
    """``tasks.finetune``'s last line on a GPU: the plan's step (against the median after two steps) and both peaks
    (against the run's), each with the plan's error; nothing where the plan predicted no step (the CPU's)."""
    plan = Plan("resident", 32, "gpu", "none", 0.5, 60 * GIB, 4 * GIB)
    rows = [{"step_s": s, "peak_gpu_gib": g, "peak_rss_gib": h}
            for s, g, h in ((9.0, 50.0, 3.0), (0.6, 62.5, 5.0), (0.45, 62.5, 5.0), (0.4, 62.5, 5.0), (0.5, 62.5, 5.0))]
    assert plan.against(rows) == ("the plan against this run: step 0.450 s measured, 0.500 predicted (+11.1%); "
                                  "GPU peak (allocated) 62.500 GiB measured, 60.000 predicted (-4.0%); host peak "
                                  "5.000 GiB measured, 4.000 predicted (-20.0%)")
    assert replace(plan, step_s=0.0).against(rows) is None
    assert plan.against([dict(r, peak_gpu_gib=None) for r in rows]) is None
