"""Validation: a held-out split, the loop's eval hook, and the streamed trainer's forward-only pass.

Every trainer has ``eval_loss(tokens, targets)``: the batch's mean loss with no gradients and no
dropout, from the weights the next step would use. ``Evaluator`` is a loop hook that runs it over
the same ``K`` held-out batches every ``N`` steps (and after the last step), so the validation
curve compares like with like, and adds ``val_loss`` and ``val_ppl`` to that step's record.
"""
from __future__ import annotations

import argparse
import math

import torch

from nanotrain import model as M
from nanotrain.loss import IGNORE_INDEX
from nanotrain.train.step import Trainer, batch_denominator

Batch = tuple[torch.Tensor, torch.Tensor]


def add_eval_args(ap: argparse.ArgumentParser, val_data: bool = True) -> None:
    """The validation flags, the same in every task."""
    ap.add_argument("--val-fraction", type=float, default=0.0,
                    help="hold out the last fraction of the data for validation (e.g. 0.05)")
    if val_data:
        ap.add_argument("--val-data", default=None, help="a separate text or .jsonl file for validation")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="validation loss every N steps (and after the last; 0: after the last only)")
    ap.add_argument("--eval-batches", type=int, default=8, help="held-out batches per validation")


def split_tokens(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): the last ``val_fraction`` of the token stream held out, the same every run."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction {val_fraction} must be between 0 and 1 (e.g. 0.05)")
    cut = len(tokens) - int(len(tokens) * val_fraction)
    return tokens[:cut], tokens[cut:]


class Evaluator:
    """``hook(step)``: the validation loss of ``batches`` every ``every`` steps and at ``last_step``."""

    def __init__(self, trainer: Trainer, batches: list[Batch], every: int, last_step: int):
        if every < 0:
            raise ValueError(f"--eval-every {every} must be >= 0 (0: only after the last step)")
        if not batches:
            raise ValueError("validation needs at least one batch (--eval-batches 1 or more)")
        self.trainer, self.batches, self.every, self.last_step = trainer, batches, every, last_step

    def due(self, step: int) -> bool:
        return step == self.last_step or (self.every > 0 and step % self.every == 0)

    def evaluate(self) -> dict:
        total, count = 0.0, 0
        for x, y in self.batches:  # each batch's mean, weighted by the targets it counts
            n = int((y != IGNORE_INDEX).sum())
            total += self.trainer.eval_loss(x, y) * n
            count += n
        loss = total / max(count, 1)
        return {"val_loss": loss, "val_ppl": math.exp(loss) if loss < 700 else math.inf}

    def __call__(self, step: int) -> dict:
        return self.evaluate() if self.due(step) else {}


def streamed_eval_loss(trainer, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """``StreamTrainer.eval_loss``: its forward pass without autograd, every block layer-major (the
    tail blocks too), through the trainer's own slots; no moments travel."""
    cfg, opt, scfg = trainer.cfg, trainer.opt, trainer.scfg
    denom = batch_denominator(tokens, targets, scfg.batch, cfg)
    toks, tgts = (whole.to(trainer.device).split(scfg.micro_batch) for whole in (tokens, targets))
    slots = trainer.block_slots
    with torch.no_grad():
        opt.load("embed", trainer.embed_slot)
        opt.load("blocks.0", slots[0])
        wte, wpe = opt.weights(trainer.embed_slot)
        xs = [M.embed({"wte": wte, "wpe": wpe}, t, cfg) for t in toks]
        for i in range(cfg.n_layer):
            if i + 1 < cfg.n_layer:
                opt.load(f"blocks.{i + 1}", slots[(i + 1) % 2])
            p = dict(zip(trainer.block_keys, opt.weights(slots[i % 2])))
            xs = [trainer.block_fn(p, x, cfg) for x in xs]
            opt.release(slots[i % 2])
        opt.load("ln_f", trainer.ln_f_slot)
        ln_f = dict(zip(("ln_f_w", "ln_f_b"), opt.weights(trainer.ln_f_slot)))
        total = sum(M.head_loss({"wte": wte}, M.final_norm(ln_f, x, cfg), t, denom=denom,
                                chunk_tokens=scfg.chunk_tokens) for x, t in zip(xs, tgts))
        opt.release(trainer.ln_f_slot)
        opt.release(trainer.embed_slot)
    return float(total)
