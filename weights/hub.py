"""Files of a Hugging Face hub repository: from the local HF cache when they are there, else downloaded.

Offline, ``huggingface_hub`` retries each request five times (about 25 s) before it says so; here the cache
is tried first, and a machine that cannot reach the hub fails at once, with one line saying what to pass.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Sequence

from weights.files import INDEX, CheckpointFiles
from weights.safetensors_io import CheckpointError
from weights.tokenizer_files import TOKENIZER_FILES

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
MODEL = ("config.json", *TOKENIZER_FILES)  # a model's files but its weights
WEIGHTS = ("config.json", "model*.safetensors", INDEX)  # not the consolidated.safetensors some carry too


def is_hub_id(name: str) -> bool:
    """``owner/name``, not a path on this machine."""
    return HUB_ID.fullmatch(name) is not None and not Path(name).exists()


def has_weights(folder: Path) -> bool:
    """Whether ``folder`` holds every file of its checkpoint (an index's shards included)."""
    try:
        CheckpointFiles(folder).close()
    except CheckpointError:
        return False
    return True


def has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file()


def _unreachable() -> str | None:
    """Why the hub cannot be reached now (None: it can), asked once without retries."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=10)
    except Exception as e:  # DNS, refused, proxy and TLS errors all have different types
        first = str(e).splitlines()[0] if str(e) else ""
        return f"{constants.ENDPOINT} cannot be reached ({type(e).__name__}: {first})"
    return None


def cached(repo: str, patterns: Sequence[str], complete: Callable[[Path], bool]) -> Path | None:
    """The local HF cache's folder of hub repository ``repo`` when ``complete`` says it holds what is needed; no
    network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo, allow_patterns=list(patterns), local_files_only=True))
    except LocalEntryNotFoundError:
        return None
    return folder if complete(folder) else None


def snapshot(repo: str, patterns: Sequence[str], complete: Callable[[Path], bool], fix: str) -> Path:
    """A local folder with the files of hub repository ``repo`` matching ``patterns``, once ``complete`` says so.

    ``fix``: what the user can pass instead, for the message when the hub cannot be reached.
    """
    from huggingface_hub import snapshot_download

    folder = cached(repo, patterns, complete)
    if folder is not None:
        return folder
    why = _unreachable()
    if why is not None:
        raise CheckpointError(f"{repo} is not in the Hugging Face cache and {why}; on a machine without network, "
                              f"download it elsewhere (hf download {repo}) and {fix}")
    try:
        folder = Path(snapshot_download(repo, allow_patterns=list(patterns)))
    except Exception as e:  # not found, gated, HTTP and disk errors all have different types
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"could not download {repo} from the Hugging Face hub "
                              f"({type(e).__name__}: {first})") from e
    if not complete(folder):
        raise CheckpointError(f"the hub repository {repo} lacks the files nanotrain needs ({', '.join(patterns)})")
    return folder


def fetch_weights(repo: str) -> Path:
    """The folder of ``repo``'s config.json and safetensors (an index's shards included)."""
    return snapshot(repo, WEIGHTS, has_weights,
                    "pass its folder: --weights /path/to/folder (or start from random weights: --weights random)")
