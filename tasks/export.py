"""Export a checkpoint as a folder that serves: ``config.json``, ``generation_config.json``, bf16 safetensors (sharded
with ``model.safetensors.index.json`` past 5 GB), the model's tokenizer files and chat template. ``transformers``
(``AutoModelForCausalLM``, ``AutoTokenizer``), inference servers, ``tasks.generate --model OUT`` and
``tasks.finetune --model OUT --weights OUT`` load it.

    python -m tasks.export runs/finetune --out runs/finetune/hf          # a run folder: its latest checkpoint
    python -m tasks.export runs/finetune/step-000030 --out hf --dtype fp32 --max-shard-gib 2
    python -m tasks.export runs/finetune/step-000030 --verify            # only check its files vs SHA256SUMS

Any checkpoint exports: one process's, a sharded (``--dp``, ``--stream --dp``) or a 3D (``--tp``/``--pp``) run's,
and those of nanotrain's formats before the one sharded format (which no longer resume: export them, then start
from the folder with ``--weights``). The weights are the run's fp32 masters, rounded to ``--dtype`` to nearest.
The model is the checkpoint's own (its ``config.json``; ``--model`` to say it for an old format). The tokenizer is
the one the run read its text with (its ``--tokenizer-dir``, else the model's ``tokenizer.json``, else GPT-2's
BPE files, written as a ``tokenizer.json``); without one at hand the export says where to copy it from. The
checkpoint's files are checked against their SHA-256 (``SHA256SUMS``) before anything is written.
``tasks.consolidate`` is this command's old name.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from nanotrain.checkpoint.checksums import SUMS, verify
from nanotrain.checkpoint.disk import SaveFailed
from nanotrain.checkpoint.export import DTYPES, ExportConfig, checkpoint_in, export_checkpoint, export_masters
from nanotrain.run.cli import fail
from nanotrain.run.export import export_source
from nanotrain.tokenizer import TokenizerError
from tasks.old_checkpoints import is_old, old_masters
from weights import CheckpointError


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a checkpoint (OUT/step-N), or a run folder (OUT: its latest)")
    ap.add_argument("--out", type=Path, help="the folder to write (created, or replaced if it holds an export)")
    ap.add_argument("--dtype", choices=DTYPES, default="bf16", help="the weights' dtype in the files")
    ap.add_argument("--max-shard-gib", type=float, default=None,
                    help="the largest safetensors file, in GiB (default: 5 GB, as transformers' save_pretrained); "
                         "past it, shards and model.safetensors.index.json")
    ap.add_argument("--model", default=None, help="the model (default: the one the checkpoint holds)")
    ap.add_argument("--tokenizer-dir", default=None,
                    help="the tokenizer to ship: a folder with a tokenizer.json (and its config, chat template), or "
                         "GPT-2's vocab.bpe and encoder.json (default: the one the run read its text with)")
    ap.add_argument("--verify", action="store_true",
                    help=f"only check the checkpoint's files (any format) against its {SUMS}; writes nothing")
    args = ap.parse_args(argv)
    if args.max_shard_gib is not None and not args.max_shard_gib > 0:
        fail(f"--max-shard-gib {args.max_shard_gib} must be above 0")
    try:
        ckpt = checkpoint_in(args.checkpoint)
        if args.verify:
            checked = verify(ckpt)
            print(f"{ckpt}: every file matches its SHA-256 in {SUMS}" if checked else
                  f"{ckpt} has no {SUMS} (saved before checksums): nothing to verify")
            return
        if args.out is None:
            ap.error("--out is required (or --verify)")
        cfg, tokenizer, note = export_source(ckpt, args.model, args.tokenizer_dir)
        ecfg = ExportConfig(DTYPES[args.dtype], *([int(args.max_shard_gib * 2**30)] if args.max_shard_gib else []))
        if is_old(ckpt):
            verify(ckpt)  # nothing is exported from files that changed since the save
            files = export_masters(*old_masters(ckpt, cfg), args.out, tokenizer, ecfg)
        else:
            files = export_checkpoint(ckpt, args.out, cfg, tokenizer, ecfg)
    except (CheckpointError, TokenizerError, SaveFailed, ValueError) as e:
        fail(str(e))
    print(f"wrote {args.out} from {ckpt} ({args.dtype}): {', '.join(p.name for p in files)}")
    if note:
        print(f"note: {note}")


if __name__ == "__main__":
    main()
