"""``python -m tasks.plan``: the plan's table without a GPU, and a cap no plan meets refused in one line."""
from __future__ import annotations

import pytest

from tasks import plan


def test_the_table_says_what_runs_where_how_fast_and_what_it_takes(capsys, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    plan.main(["--model", "llama-3.1-8b", "--gpu", "H100", "--gpu-mem-gib", "24", "--host-mem-gib", "64"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("plan for llama-3.1-8b (8.03B parameters) at batch 32 x 1024, 8-bit moments, 2-byte compute, "
                        "GPU cap 24.0 GiB, host cap 64.0 GiB")
    assert "H100 as assumed (bf16 peak 989 TFLOP/s dense" in lines[1] and "host link 55.0 GB/s" in lines[1]
    assert lines[2].startswith("  allocator: expandable segments, set by nanotrain")
    assert lines[3].startswith("  streamed: micro-batch") and "embedding and head staged" in lines[3]
    assert "tokens/s, MFU" in lines[4] and lines[5].startswith("  GPU peak") and lines[6].startswith("  host peak")
    assert lines[7].startswith("  a checkpoint on disk: ") and "model file (fp32) 29.92" in lines[7]


def test_a_model_that_fits_resident_is_planned_resident(capsys):
    plan.main(["--model", "gpt2", "--gpu", "4090", "--batch", "8"])
    assert "  resident: micro-batch 8" in capsys.readouterr().out
    plan.main(["--model", "gpt2", "--gpu", "4090", "--batch", "8", "--stream"])
    assert "  streamed: micro-batch" in capsys.readouterr().out


def test_a_cap_no_plan_meets_is_one_line_naming_the_caps_that_do(capsys):
    with pytest.raises(SystemExit) as e:
        plan.main(["--model", "llama-3.1-8b", "--gpu-mem-gib", "24", "--host-mem-gib", "64", "--adam-bits", "32"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: no streaming plan fits a 24.0 GiB GPU cap and a 64.0 GiB host cap")
    assert "--host-mem-gib 9" in err and "(or --adam-bits 8)" in err
