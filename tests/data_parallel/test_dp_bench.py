"""The data-parallel benchmark's harness on CPU (gloo, 2 ranks): rows at 1 and 2 ranks, scaling, and
``--profile``'s communication figures from each row's trace. Its times mean nothing here."""
from __future__ import annotations

import json

from nanotrain.distributed import spawn
from tasks.bench import dp


def _run(argv: list[str]) -> None:
    dp.main(argv)


def test_the_dp_bench_profiles_each_row(tmp_path):
    out = tmp_path / "bench_dp.json"
    argv = ["--device", "cpu", "--model", "tiny", "--batch", "4", "--micro-batch", "2", "--seq", "32", "--rows",
            "ours-ddp,ours-zero3-held", "--warmup", "1", "--steps", "1", "--profile", "--out", str(out)]
    spawn(_run, 2, (argv,), timeout_s=120, start_method="fork")
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"ours DDP x1", "ours DDP x2", "ours ZeRO-3 held x1", "ours ZeRO-3 held x2"}
    for name, row in rows.items():
        e = row["extra"]
        assert 0 <= e["exposed_ms"] <= e["comm_ms"] <= e["profiled_step_ms"], (name, e)
        assert e["exposed_share"] == e["exposed_ms"] / e["profiled_step_ms"]
    # two ranks all-reduce (DDP) or reduce-scatter and all-gather (ZeRO-3): gloo's operators are in the trace
    assert rows["ours DDP x2"]["extra"]["comm_ms"] > 0 and rows["ours ZeRO-3 held x2"]["extra"]["comm_ms"] > 0
    assert "scaling" in rows["ours DDP x2"]["extra"]
    traces = sorted(p.name for p in (tmp_path / "bench_dp-traces").iterdir())
    assert "ours-ddp-x2-rank1.json" in traces and "ours-zero3-held-x1-rank0.json" in traces
