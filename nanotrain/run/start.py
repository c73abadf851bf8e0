"""What a run's trainer starts from: the model's leaves (``core.leaves``), each read when the trainer takes it, so a
streamed run holds what it keeps and the leaf in flight, never the model in fp32 (a 70B model's 283 GB).

A resumed run's are its checkpoint's masters; a fresh run's the ``--weights``: a nanotrain checkpoint's masters, a
Hugging Face folder's or the hub's tensors, or random ones made from ``--seed`` on the run's device (``random``
writes no file: a 70B model need not write 141 GB before it starts; the same seed gives the same weights on the
same kind of device, and every rank of a run makes the same). With ``--lora-rank``: the base's, under the pairs of the
checkpoint or fresh ones. The load is watched: its progress every few seconds, and the leaves found non-finite
named once the trainer has taken them.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, ContextManager, Iterator

import torch

from nanotrain.checkpoint.resume import load_masters, saved_masters
from nanotrain.checkpoint.slices import is_checkpoint
from nanotrain.core.leaves import Leaves, Loading
from nanotrain.core.models import model_spec
from nanotrain.run import compose, lora
from nanotrain.run.cli import warn_nonfinite
from weights import open_weights


@contextmanager
def starting_leaves(args: Any, model: Any, ckpt: Any, dtype: torch.dtype,
                    device: torch.device) -> Iterator[Leaves | None]:
    """The leaves the trainer is built from, open while it takes them (None for a 3D run that resumes or starts from
    random weights: each rank restores, or initialises by --seed, its own share)."""
    if compose.composed(args) and (ckpt is not None or args.weights == "random"):
        yield None
        return
    trained = lora.model(args, model.cfg)
    with ExitStack() as opened:
        if trained is not model.cfg:  # LoRA: the base of --weights, frozen, and the pairs: the checkpoint's, or fresh
            base = opened.enter_context(weights(args, model, dtype, device))
            leaves = lora.with_pairs(trained, base, args.seed, ckpt and load_masters(ckpt))
        elif ckpt is not None:  # a checkpoint's fp32 masters
            leaves = opened.enter_context(saved_masters(ckpt))
        else:
            leaves = opened.enter_context(weights(args, model, dtype, device))
        loading = Loading(model_spec(trained), f"{args.model} weights")
        yield loading.watch(leaves)
        warn_nonfinite(loading.bad, ckpt or args.weights)


def weights(args: Any, model: Any, dtype: torch.dtype, device: torch.device) -> ContextManager[Leaves]:
    """The --weights: a checkpoint folder's fp32 masters, or a model's own, the hub's, or random ones by --seed, made
    on ``device`` in the compute ``dtype``."""
    if is_checkpoint(args.weights):
        return saved_masters(args.weights)
    return open_weights(model.cfg, model.weights(args.weights), args.seed, dtype, device)
