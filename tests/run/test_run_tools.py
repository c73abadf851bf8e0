"""Run tools: TOML run configs under the command line, the ETA of the progress line, the step profiler."""
import json
import re

import pytest
import torch
import torch.distributed as dist

from nanotrain.core import models as M
from nanotrain.run import toml_config
from nanotrain.core.models import preset
from nanotrain.distributed import run_in_group, spawn
from nanotrain.monitor.profile import StepProfiler, parse_steps
from nanotrain.monitor.sinks import StdoutSink, clock
from nanotrain.core.train import loop
from tasks.demos.adapters import AutogradTrainer
from nanotrain.core.train.loop import LoopConfig
from nanotrain.core.tree import named_leaves
pytestmark = pytest.mark.filterwarnings("ignore")


def finetune_args(argv):
    from nanotrain.run.flags import parse_args

    return parse_args(argv)


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('model = "tiny"\nsteps = 7\nlr = 1\nlr-schedule = "cosine"\nwarmup_steps = 2\nstream = true\n'
                   'no-tensorboard = true\nout = "runs/x"\ncheckpoint = "every"\n')
    args = finetune_args(["--config", str(cfg), "--steps", "9"])
    assert (args.model, args.steps, args.lr, args.lr_schedule, args.warmup_steps) == ("tiny", 9, 1.0, "cosine", 2)
    assert args.stream is True and args.tensorboard is False and args.recompute == "every"
    assert str(args.out) == "runs/x" and isinstance(args.lr, float)
    from nanotrain.run.cli import given_dests
    from nanotrain.run.flags import parser

    assert given_dests(parser(), ["--config", str(cfg), "--steps", "9"]) == {"steps"}  # as tasks.finetune asks


@pytest.mark.parametrize("text,message", [
    ("stesp = 3\n", r"unknown key 'stesp' \(known: .*steps"),
    ('lr-schedule = "cosin"\n', "choose from constant, cosine, linear"),
    ('steps = "many"\n', "not a valid int"),
    ("steps = 2.5\n", "expected int"),
    ('stream = "yes"\n', "expected true or false"),
    ("steps = \n", "not valid TOML"),
])
def test_bad_config_files_are_named(tmp_path, capsys, text, message):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as e:
        finetune_args(["--config", str(cfg)])
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_the_saved_config_repeats_the_run(tmp_path):
    args = finetune_args(["--model", "tiny", "--steps", "5", "--lr", "3e-4", "--no-tensorboard", "--stream",
                          "--min-lr", "1e-5", "--out", str(tmp_path / "o")])
    toml_config.write_config(args, tmp_path / "config.toml")
    again = finetune_args(["--config", str(tmp_path / "config.toml")])
    assert {k: v for k, v in vars(again).items() if k != "config"} == {k: v for k, v in vars(args).items()
                                                                       if k != "config"}


CFG = preset("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=64)


def tiny_trainer(after_backward=None):
    params = M.init_params(CFG, seed=0)
    leaves = [t.requires_grad_() for _, t in named_leaves(params)]
    return AutogradTrainer(params, lambda x, y: M.loss(params, x, y, CFG), torch.optim.AdamW(leaves), CFG,
                           after_backward=after_backward)


def batch():
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return x, x


def test_progress_line_has_the_eta(capsys):
    records = loop.run(tiny_trainer(), batch, LoopConfig(4, 2, 8), [StdoutSink()], torch.device("cpu"))
    etas = [r["eta_s"] for r in records]
    assert etas[0] is None and etas[-1] == 0.0 and all(e > 0 for e in etas[1:-1])
    assert "ETA 0:00" in capsys.readouterr().out
    assert clock(3723) == "1:02:03" and clock(59.6) == "1:00"


def test_profiler_writes_a_trace_and_a_summary(tmp_path):
    assert parse_steps("2:3") == (2, 3)
    with pytest.raises(ValueError, match="expected FIRST:LAST"):
        parse_steps("2-3")
    prof = StepProfiler(2, 3, tmp_path, torch.device("cpu"))
    loop.run(tiny_trainer(), batch, LoopConfig(4, 2, 8), [], torch.device("cpu"), hooks=[prof])
    trace = json.loads((tmp_path / "trace-rank0.json").read_text())
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    assert (tmp_path / "summary-rank0.txt").read_text().startswith("steps 2-3, rank 0: ")


def _profiled_rank(rank, world, out):
    trainer = tiny_trainer()
    trainer.after_backward = lambda: [dist.all_reduce(p.grad) for _, p in trainer.named_parameters()]
    prof = StepProfiler(1, 2, out, torch.device("cpu"), rank=rank)
    loop.run(trainer, batch, LoopConfig(2, 2, 8), [], torch.device("cpu"), hooks=[prof])


def test_each_rank_writes_its_trace_with_the_communication_share(tmp_path):
    spawn(run_in_group, 2, ("gloo", _profiled_rank, str(tmp_path)), timeout_s=60, start_method="fork")
    for rank in range(2):
        assert (tmp_path / f"trace-rank{rank}.json").is_file()
        head = (tmp_path / f"summary-rank{rank}.txt").read_text().splitlines()[0]
        share = float(re.search(r"([0-9.]+)% of it in communication", head).group(1))
        assert share > 0, head
        tail = (tmp_path / f"summary-rank{rank}.txt").read_text().splitlines()[-1]
        found = re.search(r"per step: ([0-9.]+) ms, of which exposed .* ([0-9.]+) ms", tail)
        comm, exposed = map(float, found.groups())
        assert 0 < exposed <= comm, tail  # blocking all-reduces on the CPU: exposed, most of them


def test_exposed_communication_is_what_no_other_work_covers():
    from nanotrain.monitor.trace import communication_ms
    kernel = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [kernel("gemm", 0, 1000), kernel("ncclAllReduce", 500, 1000), kernel("gemm", 1800, 100),
              {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 0, "dur": 5000}]  # CPU ops: ignored
    assert communication_ms(events, lambda n: "nccl" in n.lower() or "c10d" in n) == (1.0, 0.5)
