"""Write a sharded checkpoint's weights as one HF-layout ``model.safetensors`` that ``tasks.generate``
and ``transformers`` load.

    python -m tasks.consolidate runs/finetune/step-000030 --out runs/finetune/hf

The model preset is read from the checkpoint (the run's own arguments), or given with ``--model``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nanotrain.cli import model_config
from nanotrain.data_parallel.checkpoint import MANIFEST, consolidate, is_sharded
from weights.safetensors_io import CheckpointError


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a step-N folder written with --sharded-save")
    ap.add_argument("--out", type=Path, required=True, help="folder for model.safetensors and config.json")
    ap.add_argument("--model", default=None, help="the model preset (default: the one the run trained)")
    args = ap.parse_args(argv)
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
