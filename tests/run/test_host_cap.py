"""A run whose host memory passes --host-mem-gib stops in one line that says how to fit: a higher cap, and 8-bit
moments only where the run has 32-bit ones."""
import pytest

from nanotrain.core.train import loop
from tests.conftest import SHAKESPEARE, TOKENIZER_DIR

RUN = ["--model", "tiny", "--batch", "4", "--seq", "32", "--steps", "1", "--data", str(SHAKESPEARE),
       "--tokenizer-dir", str(TOKENIZER_DIR), "--no-tensorboard", "--no-save", "--out", "run"]


@pytest.mark.parametrize("bits, advice", [("32", "raise the cap or use --adam-bits 8"), ("8", "raise the cap")])
def test_the_host_cap_error_advises_only_what_the_run_lacks(offline_files, tmp_path, monkeypatch, bits, advice):
    from tasks.finetune import main

    def over(*args, **kwargs):
        raise loop.HostMemoryExceeded("peak RSS 9.00 GiB went over --host-mem-gib 8.0 at step 1 (the plan's estimate "
                                      "of the process was too low); raise the cap")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loop, "run", over)
    with pytest.raises(SystemExit) as e:
        main([*RUN, "--adam-bits", bits])
    assert str(e.value).endswith(f"at step 1 (the plan's estimate of the process was too low); {advice}"), e.value
