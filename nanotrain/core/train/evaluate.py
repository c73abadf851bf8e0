"""Validation: a held-out split, the loop's eval hook, and the streamed trainer's forward-only pass.

Every trainer has ``eval_loss(tokens, targets, positions=None)``: the batch's mean loss with no gradients and no
dropout, from the weights the next step would use. ``Evaluator`` is a loop hook that runs it over
the same ``K`` held-out batches every ``N`` steps (and after the last step), so the validation
curve compares like with like, and adds ``val_loss`` and ``val_ppl`` to that step's record.
"""
from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from nanotrain.data.batches import IGNORE_INDEX
from nanotrain.core.models import run
from nanotrain.core.models.ops import PLAIN
from nanotrain.core.models.spec import Unit
from nanotrain.core.train.step import Trainer, batch_denominator, micro_batches
from nanotrain.core.tree import Tree, set_path

Batch = tuple[torch.Tensor, ...]  # (tokens, targets), and packed rows' positions


def add_eval_args(ap: argparse.ArgumentParser, val_data: bool = True) -> None:
    """The validation flags, the same in every task."""
    ap.add_argument("--val-fraction", type=float, default=0.0,
                    help="hold out the last fraction of the data for validation (e.g. 0.05)")
    if val_data:
        ap.add_argument("--val-data", default=None, help="a separate text or .jsonl file for validation")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="validation loss every N steps (and after the last; 0: after the last only)")
    ap.add_argument("--eval-batches", type=int, default=8, help="held-out batches per validation")


class Evaluator:
    """``hook(step)``: the validation loss of ``batches`` every ``every`` steps and at ``last_step``."""

    def __init__(self, trainer: Trainer, batches: list[Batch], every: int, last_step: int):
        if every < 0:
            raise ValueError(f"--eval-every {every} must be >= 0 (0: only after the last step)")
        if not batches:
            raise ValueError("validation needs at least one batch (--eval-batches 1 or more)")
        self.trainer, self.batches, self.every, self.last_step = trainer, batches, every, last_step

    def __call__(self, step: int) -> dict:
        if step != self.last_step and not (self.every > 0 and step % self.every == 0):
            return {}
        total, count = 0.0, 0
        for batch in self.batches:  # each batch's mean, weighted by the targets it counts
            n = int((batch[1] != IGNORE_INDEX).sum())
            total += self.trainer.eval_loss(*batch) * n
            count += n
        loss = total / max(count, 1)
        return {"val_loss": loss, "val_ppl": math.exp(loss) if loss < 700 else math.inf}


def place(opt: Any, tree: Tree, unit: Unit, slot: Any) -> None:
    """Put the weights of ``unit``, loaded into ``slot`` of the streamed optimizer ``opt``, into ``tree``."""
    for path, w in zip(unit.paths, opt.weights(slot)):
        set_path(tree, path, w)


def streamed_eval_loss(trainer: Any, tokens: torch.Tensor, targets: torch.Tensor,
                       positions: torch.Tensor | None = None) -> float:
    """``StreamTrainer.eval_loss``: its forward pass without autograd, every block layer-major (the
    tail blocks too), through the trainer's own slots; no moments travel."""
    spec, opt, scfg, names = trainer.spec, trainer.opt, trainer.scfg, trainer.block_names
    denom = batch_denominator(tokens, targets, scfg.batch, spec, positions)
    toks, tgts, poss = zip(*micro_batches(scfg.micro_batch, trainer.device, tokens, targets, positions))
    ops = [PLAIN.packed(pos) for pos in poss]  # each micro-batch's, carrying its documents when packed
    slots, tree = trainer.block_slots, run.empty_tree(spec)
    with torch.no_grad():
        opt.fetch(spec.embed_unit.name, trainer.embed_slot)
        opt.fetch(names[0], slots[0])
        place(opt, tree, spec.embed_unit, trainer.embed_slot)
        xs = [spec.embed(tree, t, o, None) for t, o in zip(toks, ops)]
        for i in range(spec.n_layer):
            if i + 1 < spec.n_layer:
                opt.fetch(names[i + 1], slots[(i + 1) % 2])
            p = dict(zip(trainer.block_keys, opt.weights(slots[i % 2])))
            xs = [trainer.fns.block(spec, p, x, o) for x, o in zip(xs, ops)]
            opt.release(slots[i % 2])
        opt.fetch(spec.head_unit.name, trainer.head_slot)
        place(opt, tree, spec.head_unit, trainer.head_slot)
        total = sum(run.head_loss(spec, tree, x, t, o, denom, scfg.chunk_tokens) for x, t, o in zip(xs, tgts, ops))
        opt.release(trainer.head_slot)
        opt.release(trainer.embed_slot)
    return float(total)
