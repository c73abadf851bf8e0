"""What a resumed run continues: the checkpoint's model and its run's settings, checked before anything is built.

A checkpoint keeps the model's ``config.json`` and, in ``trainer.json``, the settings of the run
that saved it. A resume takes every setting it is not given again from there (so an omitted
``--lr`` is the run's, not the default), says which given ones differ, and refuses those that
would make the resumed run differ from the uninterrupted one unless asked to allow them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weights import hf_config
from weights.safetensors_io import CheckpointError


@dataclass(frozen=True)
class SettingRules:
    """How a resume treats each saved setting (by argparse ``dest``); any other one is restored and its
    changes warned about."""
    kept: frozenset[str] = field(default_factory=frozenset)     # never restored: where and how this process runs
    quiet: frozenset[str] = field(default_factory=frozenset)    # restored, changes expected (the total step count)
    exact: frozenset[str] = field(default_factory=frozenset)    # a change makes the run differ: refused unless allowed
    fixed: frozenset[str] = field(default_factory=frozenset)    # the checkpoint cannot load with another value


def saved_settings(ckpt: Path) -> dict:
    """The settings of the run that saved ``ckpt`` (empty for checkpoints that did not record them)."""
    return json.loads((ckpt / "trainer.json").read_text()).get("meta", {})


def check_model(ckpt: Path, cfg: Any, model: str, saved_model: str | None) -> None:
    """Refuse to resume ``ckpt`` as another model, naming both, before anything is built."""
    saved = json.loads((ckpt / "config.json").read_text())
    ours = hf_config(cfg)
    keys = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")
    if any(saved.get(k) != ours[k] for k in keys):
        shape = f"{saved.get('n_layer')} layers x {saved.get('n_embd')} wide"
        raise CheckpointError(f"{ckpt} is {saved_model or 'another GPT-2'} ({shape}); you asked for "
                              f"{model} ({cfg.n_layer} x {cfg.n_embd}): pass --model {saved_model or '...'} "
                              f"or leave --model out to resume it")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def restore_settings(args: dict, given: set[str], saved: dict, rules: SettingRules,
                     allow_changes: bool) -> list[str]:
    """Set in ``args`` every saved setting not ``given`` on the command line (``kept`` ones aside);
    returns a warning per given setting that differs. Raises ``ValueError`` for a change to a
    ``fixed`` setting, or to an ``exact`` one without ``allow_changes``."""
    warnings, refused = [], []
    for dest, old in saved.items():
        if dest in rules.kept or dest not in args:
            continue
        if dest not in given:
            args[dest] = old
            continue
        new = args[dest]
        if new == old or dest in rules.quiet:
            continue
        if dest in rules.fixed:
            raise ValueError(f"the checkpoint was saved with {_flag(dest)} {old} and cannot be resumed with "
                             f"{_flag(dest)} {new}; leave {_flag(dest)} out to take the checkpoint's")
        change = f"{_flag(dest)} {new} (the checkpoint's run had {old})"
        if dest in rules.exact and not allow_changes:
            refused.append(change)
        else:
            warnings.append(f"warning: resuming with {change}")
    if refused:
        raise ValueError(f"resuming with {'; '.join(refused)} would not continue the run exactly; leave "
                         f"{'those' if len(refused) > 1 else 'it'} out to take the checkpoint's, or pass "
                         f"--allow-changes")
    return warnings
