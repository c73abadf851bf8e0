"""``tasks.finetune`` under this task's old flags and defaults (the tiny model on Tiny Shakespeare, fp32, the
state on the device, ``runs/train3d``): 3D training is finetune's ``--tp/--pp/--dp`` (``nanotrain.run.compose``).

    python -m tasks.train3d --tp 2 --pp 2 --dp 2 --n-layer 4 --schedule interleaved-1f1b --sp
    # = python -m tasks.finetune --model tiny ... --batch 16 --micro-batch 2 --tp 2 --pp 2 --dp 2 --n-layer 4 ...

``--microbatches M --micro-batch-size B`` make ``--batch D x M x B --micro-batch B`` (``--plan auto``:
``--global-batch`` is ``--batch``), ``--offload`` is ``--states cpu``, ``--recompute`` is ``--recompute every``,
``--weights HF`` is ``--model HF --weights HF``; every other flag is finetune's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nanotrain.cli import fail
from nanotrain.run.finetune import main as finetune

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
DEFAULTS = ["--model", "tiny", "--seq", "64", "--steps", "50", "--lr", "1e-3", "--weight-decay", "0.01", "--dtype",
            "fp32", "--states", "gpu", "--data", str(SHAKESPEARE), "--out", "runs/train3d"]  # given flags come after
GONE = {"--tokenizer": "finetune reads text with the model's tokenizer, or token files (--data .bin)",
        "--log-every": "finetune prints every step", "--jsonl": "finetune writes OUT/metrics.jsonl",
        "--timeout": "ranks wait 120 s for each other", "--export": "python -m tasks.consolidate OUT/latest --out HF"}


def finetune_argv(argv: list[str]) -> list[str]:
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--dp", "--microbatches", "--micro-batch-size", "--global-batch"):
        ap.add_argument(flag, type=int)
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--weights")
    ap.add_argument("--plan", default="manual")
    for flag in GONE:
        ap.add_argument(flag)
    old, rest = ap.parse_known_args(argv)
    for flag, why in GONE.items():
        if getattr(old, flag[2:].replace("-", "_")) is not None:
            fail(f"{flag} is gone with tasks.train3d's own loop: {why}")
    dp, micro = old.dp or 1, old.micro_batch_size or 2
    mapped = ["--plan", old.plan, "--dp", str(dp), "--states", "cpu" if old.offload else "gpu"]
    if old.plan == "auto":
        mapped += ["--batch", str(old.global_batch or 16)]
    else:
        mapped += ["--batch", str(dp * (old.microbatches or 4) * micro), "--micro-batch", str(micro)]
    mapped += ["--recompute", "every"] if old.recompute else []
    mapped += ["--model", old.weights, "--weights", old.weights] if old.weights else []
    return DEFAULTS + mapped + rest


def main(argv: list[str] | None = None) -> None:
    finetune(finetune_argv(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
