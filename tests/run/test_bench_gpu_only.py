"""The benchmarks that measure GPUs refuse a machine without one in one line, before any work (gpt2-xl on the CPU
ran for minutes; the data-parallel bench grew to 24 GB and was killed); the data-parallel bench's rows free the
previous row's models and optimizers before the next row starts, so rows share one process."""
import gc
import json
import sys
import weakref

import pytest
import torch

from nanotrain.distributed import spawn


@pytest.mark.parametrize("module, argv, smoke", [
    ("dp", [], "--device cpu --model tiny"),
    ("pipeline", [], "--device cpu"),
    ("plain_variants", [], None),
    ("stream", [], None),
    ("model", [], None),
    ("tp", [], "--device cpu"),
    ("stream_check", [], "pytest tests/stream/test_streaming.py"),
    ("optim", ["--overlap", "100"], "--device cpu without --overlap"),
    ("optim", ["--device", "cuda"], "--device cpu without --overlap"),
    ("peers.offload", ["--peer", "torchao"], None),
])
def test_a_gpu_bench_refuses_a_cpu_in_one_line(module, argv, smoke, monkeypatch, capsys):
    import importlib

    bench = importlib.import_module(f"tasks.bench.{module}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU machine, here or on a GPU one
    monkeypatch.setattr(sys, "argv", [f"tasks.bench.{module}", *argv])
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran
    err = captured.err
    assert err.startswith(f"error: tasks.bench.{module}") and err.count("\n") == 1, err
    assert "measures GPUs, and this machine has no CUDA GPU" in err and (smoke is None or smoke in err), err


BUILT: list[weakref.ref] = []


class Model:
    """A row's model: held in a reference cycle, as modules with hooks and optimizers are."""

    def __init__(self):
        self.weights, self.me = torch.zeros(1000), self


def row(*_):
    assert all(ref() is None for ref in BUILT), "the previous row's model is still alive"
    model = Model()
    BUILT.append(weakref.ref(model))
    return (lambda: model.weights.add_(1)), (lambda: None)


def _rows(argv: list[str]) -> None:
    from tasks.bench import dp

    gc.disable()  # only the bench's own collection frees a cycle
    dp.ROWS = {"a": ("row a", row), "b": ("row b", row)}
    dp.main(argv)


def test_the_dp_bench_frees_each_rows_models_before_the_next(tmp_path):
    out = tmp_path / "rows.json"
    spawn(_rows, 2, (["--device", "cpu", "--model", "tiny", "--rows", "a,b", "--warmup", "0", "--steps", "1",
                      "--out", str(out)],), timeout_s=60, start_method="fork")
    rows = [r["name"] for r in json.loads(out.read_text())["rows"]]
    assert rows == ["row a x1", "row a x2", "row b x1", "row b x2"]  # a failing row is left out: none failed
