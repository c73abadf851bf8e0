"""A run's LoRA flags (``--lora-rank`` and the rest), the adapted spec the trainer gets, and its starting leaves:
the base's weights (from ``--weights``, frozen) and the pairs, fresh (PEFT's init, from ``--seed``) or a
checkpoint's. A LoRA run's checkpoint holds its pairs in the one format, their settings in PEFT's
``adapter_config.json`` beside (``checkpoint.state``); its export is a PEFT adapter folder (``checkpoint.export``).
The flags are fields of the run's frozen ``RunConfig`` like any other (``run.flags``), checked in its ``check_args``.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from nanotrain.core.models import model_spec, run
from nanotrain.core.models.lora import LoraConfig, with_lora
from nanotrain.core.models.spec import ModelSpec
from nanotrain.core.leaves import Leaves, held, joined


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--lora-rank", type=int, default=None,
                    help="train rank-R LoRA adapters on a frozen base instead of every weight (saved as a PEFT "
                         "adapter folder; nanotrain/core/models/lora.py)")
    ap.add_argument("--lora-alpha", type=float, default=None, help="LoRA's alpha: the pairs scale by alpha / rank "
                                                                   "(default 2 x rank)")
    ap.add_argument("--lora-targets", default=None,
                    help="the matrices adapted, comma-separated: for the Llama class q,k,v,o,gate,up,down; for GPT-2 "
                         "qkv,o,up,down (default: the attention's, q,k,v,o or qkv,o)")
    ap.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on each pair's input")
    ap.add_argument("--lora-base-bits", type=int, default=16, choices=[16, 4],
                    help="the frozen base's blocks' matrices in the compute dtype (16) or NF4 (4: QLoRA, "
                         "nanotrain/core/nf4.py), dequantised at each matmul")


def config(args: Any, cfg: Any) -> LoraConfig | None:
    """The run's ``LoraConfig`` (None without ``--lora-rank``); a bad value is a ``ValueError`` naming it."""
    if args.lora_rank is None:
        return None
    alpha = 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha
    spec = model_spec(cfg)
    targets = (tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()) if args.lora_targets else
               tuple(name for name, weight, _ in spec.lora_targets if weight in spec.attn_keys))
    return LoraConfig(args.lora_rank, alpha, targets, args.lora_dropout)


def check(args: Any, cfg: Any) -> str | None:
    """What is wrong with the LoRA flags for this run, in one line (None: nothing)."""
    try:
        lcfg = config(args, cfg)
        if lcfg is not None:
            with_lora(model_spec(cfg), lcfg)
    except ValueError as e:
        return f"{e}"
    if lcfg is None and args.lora_base_bits != 16:
        return "--lora-base-bits stores a frozen base: it needs --lora-rank"
    if lcfg is not None and (args.tp > 1 or args.pp > 1 or args.dp > 1 and (args.stream or args.zero == 3)):
        return ("--lora-rank trains adapters resident or --stream in one process, or resident with --dp (--zero 0, 1 "
                "or 2) for now; drop --tp, --pp, and --stream or --zero 3 with --dp")
    return None


def model(args: Any, cfg: Any) -> Any:
    """What the trainer is built for: the adapted spec with ``--lora-rank``, else the config itself."""
    lcfg = config(args, cfg)
    return cfg if lcfg is None else with_lora(model_spec(cfg), lcfg)


def with_pairs(spec: ModelSpec, base: Leaves, seed: int, saved: dict[str, torch.Tensor] | None = None) -> Leaves:
    """The adapted model's leaves: ``base``'s (the base spec's, read as taken) and the pairs, ``saved`` (a checkpoint's
    masters) or fresh from ``seed`` (on the CPU: the same pairs on any device)."""
    pairs = saved if saved is not None else dict(run.init_stream(spec, seed, trainable_only=True))
    return joined(base, held(run.tree_from(spec, pairs.items())))
