"""Command-line pieces shared by the tasks: model, weights, tokenizer and device options, and bad-input exits."""
from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch

from nanotrain.core.models import PRESETS, model_spec
from nanotrain.core import recipe
from nanotrain.tokenizer import Tokenizer, TokenizerError
from weights import CheckpointError, ResolvedModel, resolve_model

# Where the shared GPT-2 tokenizer files sit beside a checkout (``../shared/data/gpt2-tokenizer``).
_SHARED_TOKENIZER = Path("shared") / "data" / "gpt2-tokenizer"
TOKENIZER_ENV = "NANOTRAIN_TOKENIZER_DIR"


def fail(message: str) -> NoReturn:
    """Stop a task on a bad input: one ``error: ...`` line on stderr and exit status 2, argparse's own.

    The ``SystemExit`` carries the line as its text (what tests match), and 2 as its exit code.
    """
    print(f"error: {message}", file=sys.stderr, flush=True)
    exc = SystemExit(f"error: {message}")
    exc.code = 2
    raise exc


def add_model_args(ap: argparse.ArgumentParser, default_model: str = "gpt2",
                   default_weights: str | None = "hub") -> None:
    """``default_weights`` None: the model's own weights for a folder or a hub id, random ones for a preset
    (``own_weights``)."""
    ap.add_argument("--model", default=default_model,
                    help=f"a preset ({', '.join(PRESETS)}), a folder in the Hugging Face layout (config.json, "
                         f"safetensors, tokenizer files) or a hub id (meta-llama/Llama-3.2-1B)")
    default = ("the model's own: a folder's or a hub id's; 'random' for a preset" if default_weights is None
               else repr(default_weights))
    ap.add_argument("--weights", default=default_weights,
                    help=f"'hub' (the model's pretrained weights: a preset's or a hub id's from Hugging Face, a "
                         f"folder's own), 'random' (seeded init, HF layout), or a checkpoint folder or file "
                         f"(default: {default})")
    ap.add_argument("--tokenizer-dir", default=None,
                    help=f"folder with a tokenizer.json, or GPT-2's vocab.bpe and encoder.json (default: the model's "
                         f"own: its folder's tokenizer.json; a Llama, Qwen or Mistral preset's from its hub "
                         f"repository, offline from the Hugging Face cache; GPT-2's files from ${TOKENIZER_ENV}, else "
                         f"../shared/data/gpt2-tokenizer when it exists, else a download). Token files (--data .bin "
                         f"or .npy) need none")
    ap.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1', ...")
    ap.add_argument("--seed", type=int, default=0)


def own_weights(model: str) -> str:
    """The weights a run trains when ``--weights`` is not given: a folder's own (named, so the run's config.toml
    says which), a hub id's (``hub``), random for a preset (a preset names no pretrained weights of its own)."""
    if model in PRESETS:
        return "random"
    return model if Path(model).exists() else "hub"


def tokenizer_dir(given: str | None) -> str | None:
    """The tokenizer folder to use: the flag, else ``$NANOTRAIN_TOKENIZER_DIR``, else the shared files
    beside this checkout or the working folder when present, else None (tiktoken downloads them)."""
    if given is not None:
        return given
    if os.environ.get(TOKENIZER_ENV):
        return os.environ[TOKENIZER_ENV]
    for root in (Path.cwd().parent, Path(__file__).resolve().parents[3]):
        if (root / _SHARED_TOKENIZER).is_dir():
            return str(root / _SHARED_TOKENIZER)
    return None


def resolve(name: str) -> ResolvedModel:
    """``--model``: a preset, a Hugging Face folder or a hub id; a bad one is one line, before anything loads."""
    try:
        return resolve_model(name)
    except CheckpointError as e:
        fail(str(e))


def model_config(name: str) -> Any:
    return resolve(name).cfg


def model_tokenizer(model: ResolvedModel, given: str | None) -> Tokenizer:
    """The model's tokenizer: ``--tokenizer-dir`` when given, else its own ``tokenizer.json`` (its folder's, a preset's
    hub repository's: ``fetch_tokenizer_folder``), else (GPT-2's family) GPT-2's BPE from the files ``tokenizer_dir``
    finds. One that cannot be had, or has more tokens than the model has embeddings, is refused in one line."""
    try:
        tok = recipe.tokenizer(model, given, bpe_files=tokenizer_dir(None))
    except (TokenizerError, CheckpointError) as e:
        fail(str(e))
    vocab = model_spec(model.cfg).vocab_size
    if tok.n_vocab > vocab:
        fail(f"the tokenizer ({given or model.tokenizer_folder() or tok.name}) has {tok.n_vocab} tokens, more than the {vocab} embeddings of "
             f"{model.name}; pass --tokenizer-dir with the model's own tokenizer")
    return tok


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(f"--device {name} asked for, but this machine has no CUDA GPU (use --device cpu)")
    return device


def given_dests(ap: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The settings (argparse ``dest``) given on the command line, as opposed to left at their defaults (or set by
    ``--config``, which ``ap`` may lack: ``toml_config.parse_args`` adds it, and has checked ``argv`` already)."""
    probe = copy.deepcopy(ap)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return set(vars(probe.parse_known_args(argv)[0]))


def warn_nonfinite(bad: list[str], source: object) -> None:
    """Say which loaded tensors hold inf/NaN (``bad``, their paths): every step on them is skipped, and the run stops
    after ``--max-skipped-steps``."""
    if bad:
        print(f"warning: {source} holds inf/NaN in {len(bad)} tensors ({', '.join(bad[:5])}"
              f"{', ...' if len(bad) > 5 else ''}): their steps will have a non-finite loss and be skipped",
              flush=True)
