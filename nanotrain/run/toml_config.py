"""Run configs as TOML files: ``--config run.toml`` holds any flag, the command line overrides it.

A key is a flag's long name or its destination (``lr-schedule``, ``lr_schedule``), a value the
TOML type of the flag (``steps = 30``, ``lr = 3e-4``, ``stream = true``, ``out = "runs/x"``);
flags without a value (``--stream``, ``--no-tensorboard``) take ``true`` or ``false``. Values are
checked as the command line checks them, and an unknown key is an error that lists the known
ones. ``write_config`` saves a run's resolved flags in the same form, so a run's ``config.toml``
repeats it: ``--config runs/x/config.toml``. Parsed by ``tomllib`` (Python 3.11+); configs are
data, never executed.
"""
from __future__ import annotations

import argparse
import json
import math
import tomllib
from pathlib import Path


class ConfigError(ValueError):
    pass


def _load(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None


def _value(action: argparse.Action, key: str, value, flag_key: bool, path: Path):
    """``value`` as the flag's destination would hold it, or an error naming the key and the fix."""
    where = f"--config {path}: {key} = {value!r}"
    if action.nargs == 0:  # store_true / store_false: true means "the flag was given"
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false")
        return (action.const if value else action.default) if flag_key else value
    kind = action.type or str
    name = getattr(kind, "__name__", str(kind))
    if isinstance(value, (bool, dict, list)):
        raise ConfigError(f"{where}: expected {name}, as on the command line")
    if kind is float and isinstance(value, int):
        value = float(value)
    try:
        value = kind(value) if isinstance(value, str) else value
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: not a valid {name}") from None
    if isinstance(kind, type) and not isinstance(value, kind):
        raise ConfigError(f"{where}: expected {name}")
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where}: choose from {', '.join(map(str, action.choices))}")
    return value


def config_defaults(ap: argparse.ArgumentParser, path: Path) -> dict:
    """The destinations and values a config file sets, checked against ``ap``'s flags."""
    by_key: dict[str, tuple[argparse.Action, bool]] = {}
    for action in ap._actions:
        if action.dest in ("help", "config"):
            continue
        by_key[action.dest] = (action, False)
        for opt in action.option_strings:
            if opt.startswith("--"):
                by_key[opt[2:].replace("-", "_")] = (action, opt[2:].replace("-", "_") != action.dest)
    out = {}
    for key, value in _load(path).items():
        norm = key.replace("-", "_")
        if norm not in by_key:
            known = sorted(a.dest for a, alias in by_key.values() if not alias)
            raise ConfigError(f"--config {path}: unknown key {key!r} (known: {', '.join(known)})")
        action, flag_key = by_key[norm]
        out[action.dest] = _value(action, key, value, flag_key, path)
    return out


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``ap.parse_args(argv)`` with ``--config FILE`` added: the file's values become the defaults."""
    ap.add_argument("--config", default=None, metavar="FILE.toml",
                    help="a TOML file of flags (long names as keys); flags on the command line override it")
    known, _ = ap.parse_known_args(argv)
    if known.config is not None:
        try:
            ap.set_defaults(**config_defaults(ap, Path(known.config)))
        except ConfigError as e:
            ap.error(str(e))  # exit status 2, as for a bad flag
    return ap.parse_args(argv)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a TOML basic string


def write_config(args: argparse.Namespace, path: Path) -> None:
    """The resolved flags as TOML (unset ones as comments), readable back with ``--config``."""
    lines = ["# The resolved flags of a run: repeat it with --config THIS_FILE (command-line flags override)"]
    for key, value in sorted(vars(args).items()):
        if key == "config":
            continue
        lines.append(f"# {key} = (unset)" if value is None else f"{key} = {_toml(value)}")
    path.write_text("\n".join(lines) + "\n")
