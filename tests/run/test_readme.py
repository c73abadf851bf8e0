"""The README's commands, run as written from a fresh clone (a folder beside ``shared/data``, as a checkout is),
do what the README says. Every command of its ``bash`` blocks is listed here: run (with tiny sizes added where
it would train for minutes, and a small stand-in for a folder it names), or skipped with why: it needs a GPU, the
network, minutes of CPU processes whose path the engines' own tests run small, or another test runs it as written
already. A command the README gains must
be listed here before this test passes; one it loses, likewise. The Python block runs too, on a tiny model."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SHARED_DATA

TINY = "--batch 4 --micro-batch 2 --seq 32"
GPU, NETWORK = "needs a CUDA GPU", "needs the network (a hub model)"
SLOW = "minutes of CPU processes: {}, run small by {}"
RUN_BY = "run as written by {} (the suite's time spent once)"
SHORT = f"--warmup-steps 1 {TINY} --out runs/just"  # the recipe's run made tiny, beside Qwen's runs/finetune
QWEN = "python -m tasks.finetune --model ./Qwen2.5-0.5B --data chat.jsonl --steps 200"

# Each README command: what to append (or a replacement command, or a skip reason), and what its output must show.
COMMANDS: dict[str, tuple[str, str] | str] = {
    'pip install torch==2.13.0 && pip install -e ".[dev]"': NETWORK.replace("a hub model", "a package index"),
    "just test": "the suite itself",
    "python -m tasks.finetune --model meta-llama/Llama-3.2-1B --weights hub --data my.jsonl --gpu-mem-gib 11": GPU,
    QWEN: (f"{QWEN} --steps 2 {TINY} --dp 2 --zero 1 --sharded-save", "saved runs/finetune/step-000002"),
    "python -m tasks.plan --model llama-3.1-8b --gpu 4090 --gpu-mem-gib 24 --host-mem-gib 64 --adam-bits 8 "
    "--batch 32": (
        "", "host peak"),
    "python -m tasks.export runs/finetune --out hf-out": ("", "hf-out"),
    "python -m nanotrain.core.recipe --model gpt2 --weights random --data ../shared/data/tinyshakespeare.txt "
    "--tokenizer-dir ../shared/data/gpt2-tokenizer --seq 128 --steps 10": SLOW.format(
        "gpt2's 124M parameters for 10 steps", "tests/core/test_recipe.py"),
    "python -c \"import numpy as np; np.random.default_rng(0).integers(0, 128000, 8_000_000, dtype=np.uint32)"
    ".tofile('ids.bin')\"": "the input of the GPU line below (its small twin runs)",
    "python -m tasks.finetune --model llama-3.1-8b --weights random --data ids.bin --data-dtype uint32 "
    "--gpu-mem-gib 24 --host-mem-gib 64 --adam-bits 8 --compile --batch 32 --seq 1024 --no-save": GPU,
    "python -c \"import numpy as np; np.random.default_rng(0).integers(0, 320, 200_000, dtype=np.uint16)"
    ".tofile('ids-small.bin')\"": ("", ""),
    "python -m tasks.finetune --model tiny-llama --weights random --data ids-small.bin --device cpu --batch 8 "
    "--seq 64 --steps 5 --out runs/tiny-llama": ("", "saved runs/tiny-llama/step-000005"),
    "just finetune": (f"--steps 2 {SHORT}", "saved runs/just/step-000002"),  # the recipe's flags, then these
    "just finetune --resume --steps 60": (f"--steps 3 {SHORT}", "resumed from runs/just/step-000002"),
    "just finetune-xl": (f"--steps 1 {TINY}", "saved runs/finetune-xl/step-000001"),
    'just generate gpt2 "Once upon a time"': NETWORK,
    'python -m tasks.generate --model meta-llama/Llama-3.2-1B --prompt "The meaning of life is"': NETWORK,
    "python -m tasks.generate --model /path/to/hf-folder": RUN_BY.format(
        "tests/core/test_model_folders.py::test_generate_from_a_folder_with_its_own_tokenizer"),
    "python -m tasks.generate --model tiny --weights random": RUN_BY.format(
        "tests/run/test_task_inputs.py::test_generate_offline_line_of_the_readme_finds_the_tokenizer"),
    "just bench-model": GPU,
    "python -m tasks.pipeline --schedule all --stages 4": SLOW.format(
        "4 per schedule, beside one", "tests/run/test_tasks.py::test_pipeline_task_trains_through_the_run_path"),
    "python -m tasks.tensor_parallel --model tiny --tp 2": SLOW.format(
        "2 beside one", "tests/run/test_tasks.py::test_tensor_parallel_task_trains_a_cifar_mlp_as_one_process"),
    "torchrun --nproc-per-node 8 -m tasks.finetune --dp 8 --zero 2 --model gpt2-xl --batch 512 ...": GPU,
    "python -m tasks.finetune --dp 2 --zero 1 --model tiny ...": "an elision (...): the line above, at 2 processes",
    "torchrun --nnodes 2 --node-rank K --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
    "--rdzv-id JOB -m tasks.finetune --dp 16 ...": GPU,
    "torchrun --max-restarts 3 ... --save-every 50": "an elision (...) of the lines above",
    "torchrun --nproc-per-node 2 -m tasks.finetune --dp 2 --stream --model gpt2-xl --adam-bits 8 --sharded-save "
    "--gpu-mem-gib 11 --host-mem-gib 16 ...": GPU,
    "python -m tasks.tensor_parallel --model tiny --tp 3 --sp --tp-overlap": SLOW.format(
        "3 beside one", "tests/compose/test_finetune_3d.py"),
    "python -m tasks.tensor_parallel --model tiny-llama --tp 4": SLOW.format(
        "4 beside one", "tests/tensor_parallel"),
    "torchrun --nproc-per-node 2 -m tasks.bench.tp --tp 1,2 --tp-overlap off,on --engines nanotrain": GPU,
    "torchrun --nproc-per-node 2 -m tasks.bench.tp --tp 1,2 --heads 25": GPU,
    "python -m tasks.finetune --model tiny --n-layer 4 --batch 16 --seq 64 --data ../shared/data/tinyshakespeare.txt "
    "--out runs/3d --tp 2 --pp 2 --dp 2 --schedule interleaved-1f1b --sp": SLOW.format(
        "8", "tests/compose/test_finetune_3d.py"),
    "torchrun --nproc-per-node 8 -m tasks.finetune --tp 2 --pp 2 --dp 2 ...": GPU,
    "python -m tasks.finetune --plan auto --gpus 8 ...": "an elision (...): the planner's inputs",
}


def blocks(kind: str) -> list[str]:
    return re.findall(rf"^```{kind}\n(.*?)^```", (REPO / "README.md").read_text(), re.S | re.M)


def commands() -> list[str]:
    """Every command of the README's bash blocks, continuations joined, comments dropped."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line.strip()) if not line.strip().startswith("#") else ""
            if line:
                out.append(re.sub(r"\s+", " ", line))
    return out


def test_every_readme_command_is_listed():
    assert set(COMMANDS) == set(commands()), sorted(set(commands()) ^ set(COMMANDS))


@pytest.fixture
def clone(offline_files, tmp_path):
    """A working folder as a clone beside ``shared/data`` has it, with the stand-ins the README's lines name: a
    small Qwen2 folder (its weights, its tokenizer) with instruction data."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.data.test_tokenizer_hf import write_tokenizer

    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "data").symlink_to(SHARED_DATA)
    work = tmp_path / "clone"
    Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=300, max_position_embeddings=64,
                                 tie_word_embeddings=True)).save_pretrained(work / "Qwen2.5-0.5B")
    write_tokenizer(work / "Qwen2.5-0.5B")
    (work / "chat.jsonl").write_text("".join(json.dumps({"prompt": f"What is {i} and {i}?", "response": str(2 * i)})
                                             + "\n" for i in range(40)))
    return work


def run(command: str, cwd: Path) -> str:
    venv = str(Path(sys.executable).parent)  # python and just, as an activated environment has them
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{venv}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    if command.startswith("just "):
        command = f"just --justfile {REPO / 'justfile'} --working-directory {cwd} {command[5:]}"
    done = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{command}\n{out[-3000:]}"
    return out


def test_the_readme_commands_run_on_a_cpu_as_written(clone):
    ran = []
    for command in commands():
        todo = COMMANDS[command]
        if isinstance(todo, str):
            continue
        extra, shows = todo
        line = extra if extra.startswith(("python ", "just ")) else f"{command} {extra}".strip()
        out = run(line, clone)
        assert shows in out, f"{line}\n{out[-3000:]}"
        ran.append(command)
    assert (clone / "hf-out" / "config.json").is_file() and len(ran) == 8, ran


def test_the_readme_python_block_runs_on_a_tiny_model(tmp_path, monkeypatch):
    import torch

    (block,) = blocks("python")
    monkeypatch.chdir(tmp_path)  # its random checkpoint goes under ./.cache
    code = block.replace('preset("llama-3.2-1b")', 'preset("tiny-llama")')
    scope = {"tokens": torch.randint(0, 256, (2, 16)), "targets": torch.randint(0, 256, (2, 16))}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 (the README's own code, as a reader runs it)
    untied = set() if scope["cfg"].tie_word_embeddings else {"lm_head_w"}
    assert torch.isfinite(scope["loss"]) and set(scope["params"]) == {"wte", "blocks", "norm_w"} | untied
