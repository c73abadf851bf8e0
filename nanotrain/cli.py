"""Command-line pieces shared by the tasks: model, weights, tokenizer and device options."""
from __future__ import annotations

import argparse

import torch

from nanotrain.config import PRESETS, GPT2Config


def add_model_args(ap: argparse.ArgumentParser, default_model: str = "gpt2", default_weights: str = "hub") -> None:
    ap.add_argument("--model", default=default_model, help=f"preset: {', '.join(PRESETS)}")
    ap.add_argument("--weights", default=default_weights,
                    help="'hub' (download from Hugging Face), 'random' (seeded init, HF layout) or a path "
                         "to a model.safetensors or its folder")
    ap.add_argument("--tokenizer-dir", default=None,
                    help="folder with GPT-2's vocab.bpe and encoder.json, for machines without network")
    ap.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1', ...")
    ap.add_argument("--seed", type=int, default=0)


def model_config(name: str) -> GPT2Config:
    try:
        return GPT2Config.from_name(name)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {name} asked for, but this machine has no CUDA GPU (use --device cpu)")
    return device


def cuda_index(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:N`` (the current device): some CUDA calls want the index spelled out."""
    return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device
