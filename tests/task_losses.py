"""Two task runs' losses (``python -m tasks.finetune`` and the demos, run in tests through their ``main``) on the
same data, each step's within a bound derived from the runs themselves.

Two losses taken at the same weights differ by the rounding of the loss's chain of reductions
(``conftest.chain_rtol``: another layout or thread count may reorder any of its sums). After updates the two runs'
weights differ too (each applied gradients the other's rounding moved), and the loss follows them: to first order by
the gradient at the reference's weights times the distance (``conftest.moved_by``). The metrics record neither the
weights nor the batch, so the bound reads them from the runs: both run with ``--save-every 1 --keep-last 0``, each
step's fp32 masters from its checkpoint (``checkpoint.resume.load_masters``, whatever layout saved them), the step's
batch from the reference's data position saved with it, and its gradient computed here by one process (``run_units``
on the tiny model: a fraction of a second a step).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from tests.conftest import chain_rtol, model_chain, moved_by


def metrics(run: Path, key: str = "loss") -> dict[int, float]:
    """Each step's ``key`` in a run folder's metrics, the last record of a step winning (a resumed run repeats the
    steps after its checkpoint)."""
    rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r[key] for r in rows if key in r}


def assert_first_losses(ours: list[float], ref: list[float], cfg: Any, seq: int = 0, tokens: int = 0) -> None:
    """Losses each pair of which is taken at the same weights (two runs' first steps, or the first after one
    checkpoint's state): within the loss chain's bound (``model_chain`` of ``cfg`` on ``tokens`` targets in rows of
    ``seq``, or ``cfg`` a list, the loss's reductions themselves: a vision model's)."""
    assert len(ours) == len(ref), (ours, ref)
    bound = chain_rtol(cfg if isinstance(cfg, list) else model_chain(cfg, seq, tokens, "loss"))
    for a, b in zip(ours, ref):
        assert abs(a - b) <= bound * abs(b), f"losses {ours} and {ref}: {abs(a - b) / abs(b):.2e} apart " \
                                             f"(bound {bound:.2e}, the same weights)"


def assert_task_losses(ours: Path, ref: Path, cfg: Any, seq: int, tokens: int, key: str = "loss") -> None:
    """Two fresh runs' ``key`` ("loss", or "val_loss") at every step, from their folders ``ours`` and ``ref`` (both
    saved with ``--save-every 1 --keep-last 0``): each within the loss chain's rounding (``model_chain`` of ``cfg`` on
    ``tokens`` targets in rows of ``seq``) plus what the distance between the weights the two took it at moves it
    (``moved_by``; the second order, under the square of a few steps' lr an element, neglected). A step's loss is
    taken at the weights its previous step saved (the first at both runs' start), a validation loss at its step's."""
    got, want = metrics(ours, key), metrics(ref, key)
    assert got.keys() == want.keys() and want, (got, want)
    rounding = chain_rtol(model_chain(cfg, seq, tokens, "loss"))
    at = {step: step - 1 if key == "loss" else step for step in want}  # the weights each was taken at
    taken = batches(ref, sorted(set(at.values()) - {0}), key)
    for step, b in want.items():
        moved = 0.0
        if at[step]:  # after updates: the two runs' weights apart
            weights = masters(ref, at[step])
            moved = moved_by(gradient(cfg, weights, taken[at[step]]), masters(ours, at[step]), weights)
        assert abs(got[step] - b) <= rounding * abs(b) + moved, \
            f"{key} at step {step}: {got[step]} against {b}, {abs(got[step] - b):.2e} apart (bound: the chain's " \
            f"{rounding * abs(b):.2e}, and {moved:.2e} the weights' distance moves it)"


def checkpoint(run: Path, step: int) -> Path:
    ckpt = run / f"step-{step:06d}"
    assert ckpt.is_dir(), f"{ckpt} is missing: run both with --save-every 1 --keep-last 0 to bound every step's loss"
    return ckpt


def masters(run: Path, step: int) -> dict[str, torch.Tensor]:
    from nanotrain.checkpoint.resume import load_masters

    return load_masters(checkpoint(run, step))


def batches(run: Path, steps: list[int], key: str) -> dict[int, list[tuple[torch.Tensor, ...]]]:
    """The batches ``run``'s ``key`` at the weights it saved at each of ``steps`` was taken on: the training data's
    next batch from the position saved with them ("loss"), or the held-out batches of every evaluation
    ("val_loss"), read as the run read them (its settings, saved with them)."""
    from nanotrain.data import DataPosition
    from nanotrain.run.folder import saved_settings
    from nanotrain.run.inputs import load_data, resolve_model, validation_batches

    if not steps:
        return {}
    args = argparse.Namespace(**saved_settings(checkpoint(run, steps[0])))
    train, held_out = load_data(args, resolve_model(args))
    if key == "val_loss":
        return dict.fromkeys(steps, validation_batches(held_out, args))
    loader, out = train.loader(args.seq, args.batch, seed=args.seed, pack=args.pack), {}
    for step in steps:
        saved = json.loads((checkpoint(run, step) / "trainer.json").read_text())["data_position"]
        loader.position = DataPosition(**saved)
        out[step] = [loader.next_batch()]
    return out


def gradient(cfg: Any, weights: dict[str, torch.Tensor],
             taken: list[tuple[torch.Tensor, ...]]) -> dict[str, torch.Tensor]:
    """The gradient of a run's loss at ``weights`` on the batches ``taken`` (the mean over their targets, as the
    run's), by path: one process, fp32 (it scales a distance ~1e-7 of the loss: its own rounding is immaterial)."""
    from nanotrain.core.models import model_spec
    from nanotrain.core.models.run import run_units, tree_from
    from nanotrain.data.batches import IGNORE_INDEX

    spec = model_spec(cfg)
    weights = {p: w.clone().requires_grad_() for p, w in weights.items()}
    tree = tree_from(spec, weights.items())
    counts = [int((batch[1] != IGNORE_INDEX).sum()) for batch in taken]
    loss = sum(n * run_units(spec, tree, tokens, targets, positions=rest[0] if rest else None)
               for n, (tokens, targets, *rest) in zip(counts, taken)) / sum(counts)
    return dict(zip(weights, torch.autograd.grad(loss, list(weights.values()))))
