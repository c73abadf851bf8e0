"""The fine-tuning run's inputs: the model (``--model``, a preset's depth changed by ``--n-layer``), its tokenizer
(when the data is text), the training data and the held-out data (text, documents, instruction data, token
files: ``nanotrain.data``), and the check that a resumed run reads the data its checkpoint was trained on."""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from nanotrain.run.cli import fail, model_tokenizer, resolve
from nanotrain.data import DataFingerprint, TrainingData, open_data, read_chat_template, what_changed
from nanotrain.data.token_files import TOKEN_FILES
from nanotrain.core.models import PRESETS, model_spec, preset
from nanotrain.run.folder import saved_settings
from nanotrain.checkpoint.slices import is_checkpoint
from weights import CheckpointError, ResolvedModel
from weights.files import tensor_files
from weights.hub import is_hub_id


def resolve_model(args: argparse.Namespace) -> ResolvedModel:
    """``--model``, with ``--n-layer`` blocks instead of a preset's own (its weights then random)."""
    model = resolve(args.model)
    if args.n_layer is None:
        return model
    if args.model not in PRESETS or args.weights != "random":
        fail(f"--n-layer {args.n_layer} makes a preset of another depth, with random weights: pass a preset as "
             f"--model and --weights random (not --model {args.model} --weights {args.weights}), or leave it out")
    return replace(model, cfg=preset(args.model, n_layer=args.n_layer))


def check_weights(args: argparse.Namespace, model: ResolvedModel) -> None:
    """The weights a fresh run starts from are there, said before anything starts: a local ``--weights`` (a folder's
    own by default) holds a checkpoint."""
    source = model.weights(args.weights)
    try:
        if source not in ("random", "hub") and not is_hub_id(source) and not is_checkpoint(source):
            tensor_files(source)  # a checkpoint's masters load through checkpoint.resume (its manifest is checked)
    except CheckpointError as e:
        if model.folder is not None and Path(source) == model.folder:
            fail(f"--model {args.model} has a config.json but no weights (neither model.safetensors nor "
                 f"model.safetensors.index.json): pass --weights random to train it from scratch, or --weights "
                 f"PATH for weights kept elsewhere")
        fail(f"--weights {args.weights}: {e}")
    print(f"weights: {source}" + (f" (seed {args.seed})" if source == "random" else ""), flush=True)


def load_data(args: argparse.Namespace, model: ResolvedModel) -> tuple[TrainingData, TrainingData | None]:
    """The training data and the held-out data (None without --val-fraction or --val-data). Token files need
    no tokenizer: a run on them never loads one."""
    if args.val_data is not None and args.val_fraction:
        raise ValueError("give --val-data or --val-fraction, not both")
    sources = [s for s in (args.data, args.val_data) if s is not None]
    tok = None if all(Path(s).suffix in TOKEN_FILES for s in sources) else model_tokenizer(model, args.tokenizer_dir)
    template = read_chat_template(args.tokenizer_dir or model.tokenizer_folder())
    vocab = model_spec(model.cfg).vocab_size

    def open_source(source: str) -> TrainingData:
        return open_data(source, tok, vocab, args.data_dtype, template)

    data = open_source(args.data)
    if args.val_data is not None:
        return data, open_source(args.val_data)
    if args.val_fraction:
        return data.split(args.val_fraction)
    if args.eval_every:
        raise ValueError(f"--eval-every {args.eval_every} needs held-out data: add --val-fraction 0.05 or --val-data "
                         f"FILE")
    return data, None


def check_data(ckpt: Path, now: DataFingerprint, allow_changes: bool) -> None:
    """Refuse to resume on other data than the checkpoint's (its data position would pick other batches)."""
    saved = saved_settings(ckpt).get("data_fingerprint")
    change = saved and what_changed(DataFingerprint.from_json(saved), now)
    if change and not allow_changes:
        raise ValueError(f"{change}; the resumed run would not see the batches the whole run would: resume on "
                         f"the same data, or pass --allow-changes")
    if change:
        print(f"warning: {change}", flush=True)


def validation_batches(data: TrainingData, args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``--eval-batches`` batches of the held-out data in a seeded order: the same at every eval."""
    try:
        loader = data.loader(args.seq, args.batch, seed=args.seed, pack=args.pack)
    except ValueError as e:
        raise ValueError(f"validation data: {e}") from None
    return [loader.next_batch() for _ in range(min(args.eval_batches, loader.batches_per_epoch))]
