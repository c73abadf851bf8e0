"""``python -m tasks.plan``: the plan's table without a GPU, and a cap no plan meets refused in one line."""
from __future__ import annotations

import pytest

from tasks import plan


def test_the_table_says_what_runs_where_how_fast_and_what_it_takes(capsys, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    plan.main(["--model", "llama-3.1-8b", "--gpu", "H100", "--gpu-mem-gib", "24", "--host-mem-gib", "64", "--adam-bits",
               "8", "--batch", "32"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("plan for llama-3.1-8b (8.03B parameters) at batch 32 x 1024, 8-bit moments, 2-byte compute, "
                        "GPU cap 24.0 GiB, host cap 64.0 GiB")
    assert "H100 as assumed (bf16 peak 989 TFLOP/s dense" in lines[1] and "host link 55.0 GB/s" in lines[1]
    assert lines[2].startswith("  allocator: expandable segments, set by nanotrain")
    assert lines[3].startswith("  streamed: micro-batch") and "embedding and head staged" in lines[3]
    assert "tokens/s, MFU" in lines[4] and lines[5].startswith("  GPU peak") and lines[6].startswith("  host peak")
    assert lines[7].startswith("  a checkpoint on disk: ") and "fp32 masters 29.92 + moments 20.85" in lines[7]
    # its background save copies the 50.77 GiB beside the host peak: over 64 GiB, so written at once (and said so)
    assert lines[8].startswith("  saves in the background: a host copy of 50.77 GiB a process beside its peak, ")
    assert lines[8].endswith("over the host cap, so each save is written at once, training waiting for it")


def test_a_model_that_fits_resident_is_planned_resident(capsys):
    plan.main(["--model", "gpt2", "--gpu", "4090", "--batch", "8"])
    assert "  resident (one GPU): micro-batch 8" in capsys.readouterr().out
    plan.main(["--model", "gpt2", "--gpu", "4090", "--batch", "8", "--stream"])
    assert "  streamed: micro-batch" in capsys.readouterr().out


def test_a_cap_no_plan_meets_is_one_line_naming_the_caps_that_do(capsys):
    with pytest.raises(SystemExit) as e:
        plan.main(["--model", "llama-3.1-8b", "--gpu-mem-gib", "24", "--host-mem-gib", "64", "--batch", "32"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: no plan of 32 x 1024 fits 1 GPU of 24.0 GiB and a 64.0 GiB host cap")
    assert "--host-mem-gib 9" in err and "--adam-bits 8 halves the moments" in err


def test_masters_and_moments_on_the_gpu_count_in_its_plan(capsys):
    """``--states gpu`` keeps fp32 masters (4 bytes a parameter) and AdamW's moments (8 at 32 bits) on the
    GPU: the resident plan adds them, so under the same cap it picks a smaller micro-batch."""
    from nanotrain.core.footprint import estimate, state_bytes
    from nanotrain.core.recompute import RecomputePolicy
    from nanotrain.core.models import model_spec, preset
    from nanotrain.plan.candidates import Ask, Box, Pins, resident
    from nanotrain.plan.search import search
    from nanotrain.stream.search import GPUS

    cfg, policy = preset("gpt2-large"), RecomputePolicy.parse("none")
    n = model_spec(cfg).costs.total_params
    assert state_bytes(cfg, 32) == 12 * n and state_bytes(cfg, 32, copies=2) == 24 * n
    bare, held = estimate(cfg, 4, 1024, policy), estimate(cfg, 4, 1024, policy, states=12 * n)
    assert held.states == 12 * n and held.total - bare.total == 12 * n  # allocated; the margin is the fit's
    h100 = GPUS["H100"]
    ask = lambda states: Ask(cfg, 16, 1024, 32, pins=Pins(states=states, recompute="none"))  # noqa: E731
    box = lambda cap: Box(1, cap, None, h100.costs(), h100.peer_bytes_s)  # noqa: E731
    largest = {states: max(q.micro_batch for q in resident(ask(states), box(24 * 2**30))) for states in ("cpu", "gpu")}
    assert largest == {"cpu": 8, "gpu": 4}
    plan.main(["--model", "gpt2-large", "--gpu", "H100", "--gpu-mem-gib", "24", "--adam-bits", "32", "--batch", "16",
               "--states", "gpu", "--recompute", "none"])
    out = capsys.readouterr().out
    assert "resident (one GPU): micro-batch 4:" in out and "masters and moments 8.65 GiB" in out
    with pytest.raises(MemoryError, match=r"leaving out --states gpu \(planned: "):
        search(ask("gpu"), box(8 * 2**30))


@pytest.mark.parametrize("flags, found", [
    (["--model", "llama-3.2-1b", "--batch", "32"], 1),
    (["--model", "gpt2-large", "--batch", "16", "--states", "cpu", "--gpu-mem-gib", "12"], 1),
    # 20 GiB of host: the plan's 16.32 counts the compiled functions' (``core.footprint.COMPILE_HOST_BYTES``); a
    # compiled gpt2-xl streamed under 16 stopped at step 1 on the host guard (RSS 16.35 GiB, docs/BENCHMARKS.md)
    (["--model", "gpt2-xl", "--gpu-mem-gib", "11", "--host-mem-gib", "20", "--adam-bits", "8", "--batch", "16"], 1),
    (["--model", "llama-3.2-1b", "--batch", "128"], 4),
    (["--model", "gpt2", "--batch", "8", "--seq", "128", "--gpus", "2"], 4),
    (["--model", "gpt2", "--batch", "8", "--seq", "128", "--dp", "2", "--micro-batch", "2"], 4),
])
def test_tasks_plan_prints_the_plan_tasks_finetune_runs(flags, found, monkeypatch, capsys):
    """The same flags, one parser and its defaults (32-bit moments, compiled blocks on a GPU, ...): on the same
    machine (``found`` H100s, mocked for ``tasks.finetune``), the same pick, and the same why over GPU counts."""
    from types import SimpleNamespace

    import torch

    from nanotrain.core.machine import GIB
    from nanotrain.core.models import preset
    from nanotrain.plan import run as plan_run
    from nanotrain.run import compose
    from nanotrain.run.cli import given_dests
    from nanotrain.run.flags import freeze, parse_args, parser

    monkeypatch.delenv("RANK", raising=False)
    plan.main(flags + ["--gpu", "H100", "--gpus-found", str(found)])
    predicted = capsys.readouterr().out.splitlines()
    _, _, box, _ = plan.planned(flags + ["--gpu", "H100", "--gpus-found", str(found)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: found)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(plan_run, "box", lambda *a, **k: box)  # tasks.plan's machine: the named card's rates
    args, cfg = freeze(parse_args(flags)), preset(flags[1])
    args, pins, _ = compose.plan_layout(args, frozenset(given_dests(parser(), flags)), cfg, torch.device("cuda"), True)
    out = capsys.readouterr().out.splitlines()
    if found > 1 and "--dp" not in flags:  # the launcher's pick over the GPUs: the same, and why
        assert out[-1] in (f"4 GPUs found; {predicted[-2]}", f"--gpus 2 given; {predicted[-2]}")
    else:  # one GPU, or the layout given: the run's own pick (``plan.run.plan_run``), the same line
        plan_run.pick(args, pins, cfg, box, "H100", "allocator: as set")
        assert capsys.readouterr().out.splitlines()[-1] == predicted[-1]


def test_dropout_runs_its_blocks_eagerly_and_refuses_compile_given(capsys):
    """Dropout seeds each block's masks per block and step: compiled blocks would be compiled again per seed (torch
    gives up after 8, eagerly). By default on a GPU such a run's blocks are eager, said in one line; --compile given
    is refused naming the fix; a run without dropout keeps its compiled blocks."""
    from nanotrain.core.models import preset
    from nanotrain.run.flags import eager_under_dropout, freeze, parse_args

    lora = ["--model", "tiny-llama", "--lora-rank", "4", "--lora-dropout", "0.05"]
    args = freeze(parse_args(lora, on_gpu=True))
    assert args.compile
    assert not eager_under_dropout(args, frozenset(), preset("tiny-llama")).compile
    assert "blocks run eagerly: dropout (lora 0.05)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"--compile with dropout \(lora 0.05\).*drop --compile, or the dropout"):
        eager_under_dropout(freeze(parse_args(lora + ["--compile"])), frozenset({"compile"}), preset("tiny-llama"))
    plain = freeze(parse_args(["--model", "tiny-llama"], on_gpu=True))
    assert eager_under_dropout(plain, frozenset(), preset("tiny-llama")) is plain
    gpt2 = preset("tiny", resid_pdrop=0.1)
    assert not eager_under_dropout(plain, frozenset(), gpt2).compile  # a model folder's own rates too
