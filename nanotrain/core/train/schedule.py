"""Learning-rate schedules: constant, or linear warm-up then cosine or linear decay to a minimum.

nanoGPT's convention (``train.py``, ``get_lr``): step ``it`` (counting from 0) of a warm-up of
``W`` steps uses ``lr * (it + 1) / (W + 1)``, so the first step already moves the weights; then
the rate falls from ``lr`` to ``min_lr`` over steps ``W .. decay_steps`` and stays at ``min_lr``.
A schedule is a pure function of the step, so a resumed run repeats the uninterrupted one given
the same schedule: the checkpoint stores it (``to_dict`` / ``from_dict``).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass

KINDS = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class LRSchedule:
    lr: float                   # the peak rate, reached at the end of the warm-up
    kind: str = "constant"      # constant | cosine | linear
    warmup_steps: int = 0
    decay_steps: int = 0        # the step at which ``min_lr`` is reached (nanoGPT's lr_decay_iters)
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown lr schedule {self.kind!r} (known: {', '.join(KINDS)})")
        if not self.lr >= 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= min lr ({self.min_lr}) <= lr ({self.lr})")
        if self.warmup_steps < 0:
            raise ValueError(f"warm-up steps {self.warmup_steps} must be >= 0")
        if self.kind != "constant" and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"a {self.kind} decay needs decay steps ({self.decay_steps}) above the warm-up "
                             f"({self.warmup_steps}); raise --steps or --decay-steps, or lower --warmup-steps")

    def lr_at(self, step: int) -> float:
        """The rate of step ``step``, counting from 0 (the loop's ``trainer.step_count`` before it steps)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / (self.warmup_steps + 1)
        if self.kind == "constant":
            return self.lr
        if step >= self.decay_steps:
            return self.min_lr
        ratio = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio)) if self.kind == "cosine" else 1.0 - ratio
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def describe(self) -> str:
        warm = f"{self.warmup_steps} warm-up steps, then " if self.warmup_steps else ""
        if self.kind == "constant":
            return f"lr {self.lr:g}" + (f" after {self.warmup_steps} warm-up steps" if self.warmup_steps else "")
        return f"lr {self.lr:g}: {warm}{self.kind} decay to {self.min_lr:g} at step {self.decay_steps}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LRSchedule:
        return cls(**d)


def add_schedule_args(ap: argparse.ArgumentParser) -> None:
    """The schedule's flags, the same in every task (the peak rate is the task's own ``--lr``)."""
    ap.add_argument("--lr-schedule", default="constant", choices=list(KINDS),
                    help="constant, or linear warm-up then cosine or linear decay to --min-lr (nanoGPT's)")
    ap.add_argument("--warmup-steps", type=int, default=0, help="steps of linear warm-up to --lr")
    ap.add_argument("--decay-steps", type=int, default=None,
                    help="step at which --min-lr is reached (default: --steps)")
    ap.add_argument("--min-lr", type=float, default=None,
                    help="learning rate at the end of the decay (default: lr / 10)")


def schedule_from_args(args: argparse.Namespace) -> LRSchedule:
    """The schedule of ``add_schedule_args``' flags with ``args.lr`` and ``args.steps``."""
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    decay = args.steps if args.decay_steps is None else args.decay_steps
    return LRSchedule(args.lr, args.lr_schedule, args.warmup_steps, decay, min_lr)
