"""A run's checkpoint exported as a folder that serves (``nanotrain.checkpoint.export``), with the tokenizer the run
read its text with: what ``tasks.export`` (and its old name ``tasks.consolidate``) runs, and what
``tasks.finetune --export`` and ``--export-every N`` write into ``OUT/export`` after a save.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

from nanotrain.checkpoint.disk import SaveFailed
from nanotrain.checkpoint.export import ExportConfig, export_checkpoint
from nanotrain.core.models import family_of
from nanotrain.core.models.family import GPT2_BPE
from nanotrain.run.cli import fail, tokenizer_dir
from nanotrain.tokenizer import TokenizerError
from weights import CheckpointError, ResolvedModel, resolve_model

EXPORT_DIR = "export"  # tasks.finetune's exports, in the run folder
GPT2_FILES_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"  # where tiktoken fetches them


def run_settings(ckpt: Path) -> dict:
    """The settings of the run that saved ``ckpt`` (empty when it recorded none: an old format)."""
    trainer = ckpt / "trainer.json"
    return json.loads(trainer.read_text()).get("meta", {}) if trainer.is_file() else {}


def tokenizer_source(settings: dict, model: ResolvedModel | None, given: str | None) -> tuple[Path | None, str | None]:
    """The folder whose tokenizer an export ships, else None and one line saying where to copy one from. In order:
    ``given`` (``--tokenizer-dir``), the run's own ``--tokenizer-dir`` (in ``settings``), the model's
    ``tokenizer.json`` at hand (its folder's, a preset's in the Hugging Face cache: no network), and for a family
    that reads GPT-2's BPE the files a run finds (``cli.tokenizer_dir``)."""
    for folder in (given, settings.get("tokenizer_dir")):
        if folder is not None:
            if not Path(folder).is_dir():
                raise CheckpointError(f"the tokenizer folder {folder} is not there: pass --tokenizer-dir DIR, the "
                                      f"folder with the run's tokenizer")
            return Path(folder), None
    if model is None:
        return None, "no tokenizer files written: the checkpoint does not name its model; pass --tokenizer-dir DIR"
    at_hand = model.tokenizer_folder()
    if at_hand is not None:
        return at_hand, None
    family = family_of(model.cfg)
    if family.tokenizer == GPT2_BPE:
        bpe = tokenizer_dir(None)
        if bpe is not None:
            return Path(bpe), None
        return None, (f"no tokenizer files written: GPT-2's vocab.bpe and encoder.json are not at hand; put them in a "
                      f"folder (from {GPT2_FILES_URL}) and export again with --tokenizer-dir DIR")
    where = model.folder or family.hub_ids.get(model.name, "the model's hub repository")
    return None, (f"no tokenizer files written: {model.name}'s tokenizer.json is not at hand; copy tokenizer.json, "
                  f"tokenizer_config.json and chat_template.jinja from {where} into the export, or export again with "
                  f"--tokenizer-dir DIR")


def export_source(ckpt: Path, model: str | None, given_tokenizer: str | None
                  ) -> tuple[Any, Path | None, str | None]:
    """What a checkpoint exports as: the model's config (``model`` when given, else None: the checkpoint's own
    ``config.json``), the tokenizer folder and the note of ``tokenizer_source``."""
    settings = run_settings(ckpt)
    name = model or settings.get("model")
    resolved = resolve_model(name) if name else None
    return (resolved.cfg if model else None), *tokenizer_source(settings, resolved, given_tokenizer)


def exporting(args: argparse.Namespace, save: Callable[[], Path | None], step: Callable[[], int], first: bool,
              written: Callable[[], None]) -> Callable[[], Path | None]:
    """``save`` followed, with ``--export-every N`` every N steps and with ``--export`` at the run's last step, by
    the first rank's export of what it saved to ``OUT/export`` (bf16), once ``written`` says the save (written in
    the background) is on disk. An export that fails is said in one line and
    the run goes on: its checkpoint is saved, and ``tasks.export`` exports it later."""
    if not (first and (args.export or args.export_every)):
        return save
    try:  # the tokenizer found before the first step
        tokenizer, note = tokenizer_source({"tokenizer_dir": args.tokenizer_dir}, resolve_model(args.model), None)
    except CheckpointError as e:
        fail(str(e))
    if note:
        print(f"note: {note}", flush=True)
    out = args.out / EXPORT_DIR

    def save_and_export() -> Path | None:
        path = save()
        done = step()
        if path is not None and (args.export_every and done % args.export_every == 0
                                 or args.export and done >= args.steps):
            written()  # a failed save raises here, as it would at the next save: not an export's warning
            try:
                export_checkpoint(path, out, None, tokenizer, ExportConfig())
                print(f"exported {path.name} to {out}", flush=True)
            except (CheckpointError, TokenizerError, SaveFailed, OSError) as e:
                print(f"warning: {path.name} is saved, but its export to {out} failed ({e}); training goes on, and "
                      f"python -m tasks.export {path} --out {out} exports it later", flush=True)
        return path

    return save_and_export
