"""Bad input to the tasks: one `error:` line, exit status 2, before anything is loaded or written."""
import subprocess
import sys

import pytest

from tests.conftest import REPO, SHAKESPEARE, TOKENIZER_DIR


@pytest.fixture
def offline(offline_files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # random weights and token caches would go under ./.cache
    return tmp_path


def refused(main, argv, pattern, capsys):
    with pytest.raises(SystemExit, match=pattern) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


FINETUNE = ["--model", "tiny", "--batch", "4", "--seq", "32", "--data", str(SHAKESPEARE), "--out", "run"]


@pytest.mark.parametrize("extra, pattern", [
    (["--steps", "-3"], r"--steps -3 must be at least 1"),
    (["--batch", "0"], r"--batch 0 must be at least 1"),
    (["--seq", "129"], r"--seq 129 exceeds tiny's context of 128 tokens; use --seq 128"),
    (["--lr=-1e-3"], r"--lr -0.001 must be a finite number >= 0"),
    (["--lr", "nan"], r"--lr nan must be"),
    (["--weight-decay", "-1"], r"--weight-decay -1.0 must be"),
    (["--micro-batch", "3"], r"--micro-batch 3 does not divide --batch 4; pick one of 1, 2, 4"),
    (["--recompute", "sometimes"], r"sometimes"),
    (["--tail", "3", "--stream"], r"--tail 3: tiny has only 2 blocks"),
    (["--stream", "--micro-batch", "2", "--tail-micro-batch", "3"], r"--tail-micro-batch 3 must divide --micro-batch"),
    (["--keep-last", "-1"], r"--keep-last -1 must be >= 0"),
    (["--max-skipped-steps", "-1"], r"--max-skipped-steps -1 must be >= 0"),
    (["--gpu-mem-gib", "11"], r"--gpu-mem-gib 11.0 caps GPU memory, but this run is on cpu"),
    (["--host-mem-gib", "0"], r"--host-mem-gib 0.0 must be above 0"),
    (["--model", "gpt2-xl", "--host-mem-gib", "8"], r"gpt2-xl needs about .* more than --host-mem-gib 8.0"),
    (["--data", "empty.txt"], r"the corpus has 1 tokens: 0 blocks of 32, fewer than one batch of 4"),
    (["--data", "short.txt"], r"fewer than one batch of 4; use a larger corpus"),
    (["--data", "missing.bin", "--dp", "2"], r"data file not found: missing.bin \(give a text, .jsonl, .bin or .npy"),
    (["--val-data", "missing.txt"], r"data file not found: missing.txt"),
])
def test_finetune_refuses_bad_input_before_anything_is_written(offline, capsys, extra, pattern):
    from tasks.finetune import main

    (offline / "empty.txt").write_text("")
    (offline / "short.txt").write_text("To be, or not to be, that is the question. " * 5)
    before = sorted(p.name for p in offline.iterdir())
    refused(main, FINETUNE + extra, pattern, capsys)
    after = sorted(p.name for p in offline.iterdir() if p.name != ".cache")  # a token cache may be there
    assert after == before  # no run folder, no checkpoint, no random weights (gpt2-xl would write 6 GB)
    assert not (offline / ".cache" / "random-weights").exists()


def test_generate_refuses_bad_input(offline, capsys):
    from tasks.generate import main

    base = ["--model", "tiny", "--weights", "random"]
    refused(main, base + ["--max-new-tokens", "300"],
            r"the prompt's 1 tokens and --max-new-tokens 300 exceed tiny's context of 128 tokens; "
            r"use --max-new-tokens 127 or less", capsys)
    refused(main, base + ["--top-k", "0"], r"--top-k 0 must be at least 1", capsys)
    refused(main, base + ["--temperature", "-1"], r"--temperature -1.0 must be at least 0", capsys)
    refused(main, ["--model", "gpt2-lrage"], r"unknown model 'gpt2-lrage'", capsys)
    assert not (offline / ".cache").exists()


def test_generate_offline_line_of_the_readme_finds_the_tokenizer(offline, capsys, monkeypatch):
    """`python -m tasks.generate --model tiny --weights random`, no --tokenizer-dir: the shared files are found
    (here through NANOTRAIN_TOKENIZER_DIR, as the working folder has no ../shared/data)."""
    from tasks.generate import main

    monkeypatch.setenv("NANOTRAIN_TOKENIZER_DIR", str(TOKENIZER_DIR))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(offline / "no-cache"))  # a download would land here
    main(["--model", "tiny", "--weights", "random", "--prompt", "Hello", "--max-new-tokens", "3"])
    assert "--- sample 0 ---\nHello" in capsys.readouterr().out
    assert not (offline / "no-cache").exists()


def test_a_real_process_exits_2_with_one_line(offline):
    r = subprocess.run([sys.executable, "-m", "tasks.finetune", *FINETUNE, "--steps", "-3"], cwd=offline,
                       capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert r.returncode == 2 and r.stderr == "error: --steps -3 must be at least 1\n" and r.stdout == ""


def test_pipeline_flags_pass_through_torchrun_and_bad_counts_are_refused(capsys, monkeypatch):
    from torch.distributed.run import get_args_parser

    from tasks.pipeline import parse_args

    ours = ["--virtual-stages", "2", "--stages", "2"]
    launched = get_args_parser().parse_args(["--nproc-per-node", "2", "-m", "tasks.pipeline", *ours])
    assert launched.training_script_args == ours and parse_args(ours).virtual_stages == 2
    args = parse_args([])
    assert (args.steps, args.micro_batch_size, args.seq, str(args.out)) == (20, 1, 32, "runs/pipeline")  # the demo
    with pytest.raises(SystemExit) as e:
        parse_args(["--steps", "0"])
    assert e.value.code == 2 and "error: --steps 0 must be at least 1" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert len(parse_args(["--stages", "2"]).schedules) > 1  # every schedule: a group joined for each
