"""Export a sharded checkpoint's model as a Hugging Face folder (config.json, safetensors shards and their
index, the model's tokenizer files) that ``tasks.generate --model OUT`` and ``transformers`` load.

    python -m tasks.consolidate runs/finetune/step-000030 --out runs/finetune/hf
    python -m tasks.consolidate runs/finetune/step-000030 --verify    # any checkpoint: its files vs SHA256SUMS

The model (a preset, a Hugging Face folder or a hub id) is read from the checkpoint (the run's own
arguments), or given with ``--model``. The checkpoint's files are checked against their SHA-256
(``SHA256SUMS``) before anything is exported.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from nanotrain.cli import fail, resolve
from nanotrain.data_parallel.checkpoint import MANIFEST, consolidate, is_sharded
from nanotrain.train.checksums import SUMS, verify
from weights import CheckpointError, copy_tokenizer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a step-N folder written with --sharded-save")
    ap.add_argument("--out", type=Path, help="the Hugging Face folder to write")
    ap.add_argument("--model", default=None, help="the model (default: the one the run trained)")
    ap.add_argument("--verify", action="store_true",
                    help=f"only check the checkpoint's files (any format) against its {SUMS}; writes nothing")
    args = ap.parse_args(argv)
    # Checksums (nanotrain.train.checksums): nothing is exported from files that changed since the save.
    try:
        checked = verify(args.checkpoint)
    except CheckpointError as e:
        fail(str(e))
    if args.verify:
        print(f"{args.checkpoint}: every file matches its SHA-256 in {SUMS}" if checked else
              f"{args.checkpoint} has no {SUMS} (saved before checksums): nothing to verify")
        return
    if args.out is None:
        ap.error("--out is required (or --verify)")
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
