"""Fetch GPT-2 checkpoints from the Hugging Face hub."""
from __future__ import annotations

from pathlib import Path

from weights.safetensors_io import CheckpointError

HUB_REPOS = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}


def fetch(model: str, cache_dir: str | Path | None = None, local_files_only: bool = False) -> Path:
    """Path to ``model.safetensors`` of a GPT-2 preset, downloaded (or found in the HF cache)."""
    if model not in HUB_REPOS:
        raise CheckpointError(f"no pretrained hub weights for model {model!r} (hub models: {', '.join(HUB_REPOS)}); "
                              f"use --weights random or --weights /path/to/model.safetensors")
    from huggingface_hub import hf_hub_download

    repo = HUB_REPOS[model]
    try:
        return Path(hf_hub_download(repo, "model.safetensors", cache_dir=cache_dir, local_files_only=local_files_only))
    except Exception as e:  # offline, DNS, HTTP and cache-miss errors all have different types
        raise CheckpointError(
            f"could not get {repo}/model.safetensors from the Hugging Face hub ({type(e).__name__}: {e}). "
            f"If this machine is offline, download the file elsewhere and pass --weights /path/to/model.safetensors, "
            f"or start from random weights with --weights random") from e
