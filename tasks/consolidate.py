"""Export a sharded checkpoint's model as a Hugging Face folder (config.json, safetensors shards and their
index, the model's tokenizer files) that ``tasks.generate --model OUT`` and ``transformers`` load.

    python -m tasks.consolidate runs/finetune/step-000030 --out runs/finetune/hf

The model (a preset, a Hugging Face folder or a hub id) is read from the checkpoint (the run's own
arguments), or given with ``--model``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from nanotrain.cli import fail, resolve
from nanotrain.data_parallel.checkpoint import MANIFEST, consolidate, is_sharded
from weights import CheckpointError, copy_tokenizer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a step-N folder written with --sharded-save")
    ap.add_argument("--out", type=Path, required=True, help="the Hugging Face folder to write")
    ap.add_argument("--model", default=None, help="the model (default: the one the run trained)")
    args = ap.parse_args(argv)
    if not is_sharded(args.checkpoint):
        fail(f"{args.checkpoint} has no {MANIFEST}: not a sharded checkpoint (an ordinary checkpoint is already "
             f"a Hugging Face folder)")
    name = args.model or json.loads((args.checkpoint / MANIFEST).read_text())["meta"].get("model")
    if name is None:
        fail(f"{args.checkpoint} does not say which model it holds; pass --model")
    model = resolve(name)
    try:
        path = consolidate(args.checkpoint, model.cfg, args.out)
    except (CheckpointError, ValueError) as e:
        fail(str(e))
    tokenizer = model.tokenizer_folder()
    copied = copy_tokenizer(tokenizer, args.out) if tokenizer is not None else []
    print(f"wrote {path}" + (f" and {', '.join(p.name for p in copied)}" if copied else ""))


if __name__ == "__main__":
    main()
