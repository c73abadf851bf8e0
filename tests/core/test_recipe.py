"""The recipe (``nanotrain.core.recipe``) is the one-process resident run of ``tasks.finetune``, and that run imports
no engine it does not use."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import SHAKESPEARE, TOKENIZER_DIR

REPO = Path(__file__).resolve().parents[2]
TINY = dict(model="tiny", weights="random", data=str(SHAKESPEARE), tokenizer_dir=str(TOKENIZER_DIR), seq=32, batch=4,
            micro_batch=2, steps=3, lr=1e-3, device="cpu")


def flags(settings: dict) -> list[str]:
    return [a for k, v in settings.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def test_the_recipe_trains_as_finetune_does(offline_files, tmp_path, monkeypatch):
    """The same model, weights, data and settings through the recipe and through ``tasks.finetune``: the same losses,
    bit for bit (the same computation in the same order: finetune's builder is the recipe's)."""
    from nanotrain.core.recipe import Recipe, train
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)  # random weights and token caches go under ./.cache
    ours = [r["loss"] for r in train(Recipe(**TINY), sinks=[])]
    main(flags(TINY) + ["--recompute", "none", "--out", "run", "--no-save", "--no-tensorboard"])
    theirs = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(ours) == 3 and ours == theirs


def test_a_one_process_resident_run_imports_no_other_engine(offline_files, tmp_path):
    """``tasks.finetune`` on one process without streaming loads the core and what its plan needs: not the
    tensor-parallel, pipeline or 3D engines, nor the streamed trainer (its planner's footprint aside)."""
    script = (f"import sys; from tasks.finetune import main; main({flags(TINY)!r} + ['--steps', '1', '--out', 'run', "
              f"'--no-save', '--no-tensorboard']); "
              f"import json; print('LOADED', json.dumps(sorted(m for m in sys.modules if m.startswith('nanotrain.'))))")
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=os.environ | {"PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout.split("LOADED ", 1)[1])
    engines = ("nanotrain.compose", "nanotrain.pipeline", "nanotrain.tensor_parallel", "nanotrain.stream.trainer",
               "nanotrain.data_parallel.trainer")
    assert not [m for m in loaded if m.startswith(engines)]
