"""``tasks.finetune --dp N --zero K`` end to end on the CPU: the single-process losses, and a resume
at another world size and ZeRO stage continues them."""
import json

import pytest

from tests.conftest import SHAKESPEARE, TOKENIZER_DIR


@pytest.fixture
def offline_files():
    if not (TOKENIZER_DIR.is_dir() and SHAKESPEARE.exists()):
        pytest.skip("needs ../shared/data (tokenizer files and tinyshakespeare)")


def losses(run) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


def test_finetune_data_parallel_matches_one_process_and_resumes_at_another_size(offline_files, tmp_path,
                                                                                 monkeypatch):
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    common = ["--model", "tiny", "--batch", "12", "--micro-batch", "2", "--seq", "32", "--recompute", "every",
              "--data", str(SHAKESPEARE), "--tokenizer-dir", str(TOKENIZER_DIR), "--lr", "1e-3"]
    main(common + ["--steps", "3", "--out", "one"])
    main(common + ["--steps", "2", "--out", "dp", "--dp", "2", "--zero", "1"])
    assert (tmp_path / "dp" / "latest").read_text().strip() == "step-000002"
    main(common + ["--steps", "3", "--out", "dp", "--dp", "3", "--zero", "3", "--resume"])
    ref, ours = losses(tmp_path / "one"), losses(tmp_path / "dp")
    assert len(ours) == 3 and all(abs(a - b) <= 1e-5 * b for a, b in zip(ours, ref)), (ours, ref)
    assert (tmp_path / "dp" / "step-000003" / "model.safetensors").is_file()
    with pytest.raises(SystemExit, match=r"batch 12 does not split over 3 data-parallel ranks in micro-batches of 3"):
        main(common[:4] + ["--micro-batch", "3", "--out", "bad", "--dp", "3"])
    with pytest.raises(SystemExit, match=r"--zero 3 recomputes every unit .* pass --recompute every, not 'none'"):
        main(common[:4] + ["--out", "bad", "--dp", "2", "--zero", "3"])
