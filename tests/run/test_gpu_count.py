"""The plain ``tasks.finetune`` plans over the GPUs it finds (issue 37), on the CPU with the GPUs mocked: torch's
count, availability and the card the search reads; the ranks' launch (``launch.spawn``) is caught, not run.

Without a layout flag the GPU count is planned (1 to all), the pick's flags given to the ranks started here, as if
typed; ``--gpus N`` takes N, ``--gpus 1`` and every layout flag keep today's run; torchrun's ranks plan no world.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanotrain.core.machine import GIB
from nanotrain.core.models import preset

ONE_B = ["--model", "llama-3.2-1b", "--batch", "128", "--steps", "1"]


@pytest.fixture
def gpus(monkeypatch):
    """A machine of ``n`` H100s, as far as the launcher asks: returns the function that sets ``n``."""
    from nanotrain.plan import run as plan_run

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=int(79.1 * GIB)))
    monkeypatch.setattr(plan_run, "host_available", lambda: 512 * GIB)  # a 4-GPU host's, not this machine's

    def machine(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    machine(4)
    return machine


@pytest.fixture
def launches(monkeypatch):
    """The ranks the run would start, as (world size, their command line)."""
    from nanotrain.data_parallel import launch

    started = []
    monkeypatch.setattr(launch, "spawn", lambda fn, n, args, **kw: started.append((n, list(args[0]))))
    return started


def test_four_gpus_found_plan_data_parallel_and_launch_it_with_its_flags(gpus, launches, tmp_path, capsys):
    from tasks.finetune import main

    argv = ONE_B + ["--out", str(tmp_path / "run")]
    main(argv)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("4 GPUs found; plan over 4 GPUs: "))
    flags = line.split("plan over 4 GPUs: ")[1].split(" (the fastest")[0]
    assert launches == [(4, argv + flags.split())]  # the ranks run the pick as if its flags were typed
    assert "--dp 4" in flags and "--tp" not in flags and "--stream" not in flags  # data parallelism wins here
    assert "1: " in line and "4: " in line  # why: the fastest predicted step at each GPU count
    assert out.index("plans by predicted step time") < out.index(line)


@pytest.mark.parametrize("flags", [["--gpus", "1"], ["--dp", "1"], ["--zero", "0"], ["--tp", "1"], ["--pp", "1"],
                                   ["--plan", "manual"], ["--device", "cuda:0"]])
def test_one_gpu_given_or_a_layout_flag_keeps_today_s_run(gpus, monkeypatch, flags):
    """``plan_layout`` leaves the settings as they are and asks the search nothing (the run plans on one GPU)."""
    from nanotrain.run import compose
    from nanotrain.run.cli import given_dests, pick_device
    from nanotrain.run.flags import freeze, parse_args, parser

    monkeypatch.setattr(compose, "pick_gpus", lambda *a: pytest.fail("the world was planned"))
    argv = ONE_B + flags
    args = freeze(parse_args(argv))
    out = compose.plan_layout(args, frozenset(given_dests(parser(), argv)), preset("llama-3.2-1b"),
                              pick_device(args.device), True)
    assert out == (args, frozenset(given_dests(parser(), argv)), [])


def test_an_explicit_layout_launches_as_typed(gpus, launches, tmp_path, capsys):
    from tasks.finetune import main

    argv = ONE_B + ["--dp", "2", "--out", str(tmp_path / "run")]
    main(argv)
    assert launches == [(2, argv)] and "GPUs found" not in capsys.readouterr().out


def test_gpus_n_takes_n_even_where_fewer_would_be_faster(gpus, launches, tmp_path, capsys):
    """gpt2 at 8 x 128 is fastest on one GPU (``tests/plan/test_search.py``): found, the plain command runs it there
    (no rank started); with ``--gpus 2`` it takes 2. More than the machine has is refused in one line."""
    from nanotrain.run import compose
    from nanotrain.run.cli import given_dests
    from nanotrain.run.flags import freeze, parse_args, parser

    small = ["--model", "gpt2", "--batch", "8", "--seq", "128"]
    for extra, world in (([], 1), (["--gpus", "2"], 2)):
        args = freeze(parse_args(small + extra))
        planned, pins, flags = compose.plan_layout(args, frozenset(given_dests(parser(), small + extra)),
                                                   preset("gpt2"), torch.device("cuda"), True)
        assert planned.dp * planned.tp * planned.pp == world and (flags == []) == (world == 1)
        assert {"dp", "micro_batch", "states"} <= pins  # the run builds the pick: its settings pinned
    assert "--gpus 2 given; plan over 2 GPUs: " in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--gpus 8: this machine has 4 CUDA GPUs; pass --gpus 4 or fewer"):
        from tasks.finetune import main
        main(small + ["--gpus", "8", "--out", str(tmp_path / "run")])
    assert launches == []


def test_torchrun_s_ranks_plan_no_world(gpus, monkeypatch):
    """Under torchrun (RANK set) the world is the launched one: nothing is planned over the GPUs found."""
    from nanotrain.run import compose
    from nanotrain.run.flags import freeze, parse_args

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(compose, "pick_gpus", lambda *a: pytest.fail("the world was planned"))
    args = freeze(parse_args(ONE_B))
    assert compose.plan_layout(args, frozenset({"model", "batch", "steps"}), preset("llama-3.2-1b"),
                               torch.device("cuda"), True) == (args, frozenset({"model", "batch", "steps"}), [])


def test_gpus_on_a_machine_without_one_is_refused_naming_the_flags_that_apply(tmp_path, capsys):
    from tasks.finetune import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", "--gpus", "2", "--device", "cpu", "--out", str(tmp_path / "run")])
    assert e.value.code == 2 and "--gpus 2 plans over CUDA GPUs, but this run is on cpu; --dp 2 starts" in str(e.value)
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
