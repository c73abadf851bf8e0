"""Write a sharded checkpoint's weights as one HF-layout ``model.safetensors`` that ``tasks.generate``
and ``transformers`` load.

    python -m tasks.consolidate runs/finetune/step-000030 --out runs/finetune/hf
    python -m tasks.consolidate runs/finetune/step-000030 --verify    # any checkpoint: its files vs SHA256SUMS

The model preset is read from the checkpoint (the run's own arguments), or given with ``--model``.
The checkpoint's files are checked against their SHA-256 (``SHA256SUMS``) before anything is exported.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nanotrain.cli import model_config
from nanotrain.data_parallel.checkpoint import MANIFEST, consolidate, is_sharded
from nanotrain.train.checksums import SUMS, verify
from weights.safetensors_io import CheckpointError


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a step-N folder written with --sharded-save")
    ap.add_argument("--out", type=Path, help="folder for model.safetensors and config.json")
    ap.add_argument("--model", default=None, help="the model preset (default: the one the run trained)")
    ap.add_argument("--verify", action="store_true",
                    help=f"only check the checkpoint's files (any format) against its {SUMS}; writes nothing")
    args = ap.parse_args(argv)
    # Checksums (nanotrain.train.checksums): nothing is exported from files that changed since the save.
    try:
        checked = verify(args.checkpoint)
    except CheckpointError as e:
        sys.exit(f"error: {e}")
    if args.verify:
        print(f"{args.checkpoint}: every file matches its SHA-256 in {SUMS}" if checked else
              f"{args.checkpoint} has no {SUMS} (saved before checksums): nothing to verify")
        return
    if args.out is None:
        ap.error("--out is required (or --verify)")
    if not is_sharded(args.checkpoint):
        sys.exit(f"error: {args.checkpoint} has no {MANIFEST}: not a sharded checkpoint (an ordinary checkpoint "
                 f"already holds model.safetensors)")
    model = args.model or json.loads((args.checkpoint / MANIFEST).read_text())["meta"].get("model")
    if model is None:
        sys.exit(f"error: {args.checkpoint} does not say which model it holds; pass --model")
    try:
        path = consolidate(args.checkpoint, model_config(model), args.out)
    except (CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
