"""The ``Trainer`` protocol for steps that are a loss, ``backward`` and a torch optimizer.

The pipeline and tensor-parallel engines (and the single-process references they are checked
against) train with ``torch.optim.AdamW`` over plain leaves; these adapters let the one loop in
``train.loop`` run them. State is flat: each parameter and each tensor of its optimizer state by
name, so it saves like the trainers' own.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from nanotrain.core.models import model_spec
from nanotrain.monitor.steptime import StepClock
from nanotrain.pipeline.build import Pipeline
from nanotrain.pipeline.schedule import Action
from nanotrain.pipeline.train import train_step
from nanotrain.core.train.clip import clip_factor, clipped_result, global_norm
from nanotrain.core.train.scaler import LossScaler, split_state
from nanotrain.core.train.result import StepResult
from nanotrain.core.tree import Tree, named_leaves


class AutogradTrainer:
    """``loss_fn(x, y)``, ``backward``, ``after_backward()`` (gradient reductions), ``optimizer.step()``.

    ``cfg``: the model's config, of any family (None for a model of none).
    ``eval_fn(x, y)`` is the loss without dropout, for validation (default: ``loss_fn``).
    ``clip_norm`` clips the gradients to that global norm (``train.clip``) before the update; the norm
    is over this process's parameters unless ``norm_fn()`` gives the whole model's (parameters spread
    over ranks: ``tensor_parallel.grad_norm``; the pipeline's is built in).

    ``scaler`` (fp16 compute; the parameters, the optimizer's masters, stay fp32): as ``GradScaler``,
    backward runs from the loss times the scale, the gradients are unscaled before clipping, a step
    whose gradients overflowed is skipped whole and the scale moved (``train.scaler``). The overflow
    test is the global norm's finiteness, so every rank of a spread model skips the same steps.
    """

    copy_waits = False  # whether the step has waits of its own to report (the pipeline's for its neighbours)

    def __init__(self, params: Tree, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 optimizer: torch.optim.Optimizer, cfg: Any = None,
                 after_backward: Callable[[], None] | None = None,
                 eval_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 clip_norm: float | None = None, norm_fn: Callable[[], torch.Tensor] | None = None,
                 scaler: LossScaler | None = None):
        self.params, self.loss_fn, self.opt, self.cfg = params, loss_fn, optimizer, cfg
        self.spec = None if cfg is None else model_spec(cfg)
        self.after_backward, self.eval_fn = after_backward, eval_fn or loss_fn
        self.clip_norm, self.norm_fn, self.scaler = clip_norm, norm_fn, scaler
        self.step_count = 0
        self.clock = StepClock(next(t for _, t in named_leaves(params) if isinstance(t, torch.Tensor)).device)

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, t) for n, t in named_leaves(self.params) if isinstance(t, torch.Tensor)]

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> StepResult:
        self.clock.start()
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(tokens, targets)
        self.clock.mark("backward")  # with the gradient reductions
        (loss if self.scaler is None else loss * self.scaler.scale).backward()
        if self.after_backward is not None:
            self.after_backward()
        self.clock.mark("optimizer")
        return self._update(loss, targets, self.clip_grads())

    def _update(self, loss: torch.Tensor, targets: torch.Tensor, norm: torch.Tensor | None) -> StepResult:
        """The optimizer step, unless the loss or the clipped norm is not finite: then the weights stay
        (torch's optimizers would write NaN into them). Reading the loss first costs one host sync."""
        result = clipped_result(float(loss.detach()), targets.numel(), norm, self.clip_norm)
        if not result.skipped:
            self.opt.step()
        if self.scaler is not None:
            self.scaler.record(result)
        self.step_count += 1
        self.clock.mark("end")
        times = self.clock.take()
        if not self.copy_waits:
            del times["copy_wait_s"]
        return replace(result, **times)

    def clip_grads(self) -> torch.Tensor | None:
        """Unscale (fp16) and clip to ``clip_norm``; the global norm before clipping (None with neither)."""
        if self.clip_norm is None and self.scaler is None:
            return None
        grads = [p.grad for _, p in self.named_parameters() if p.grad is not None]
        if self.scaler is not None:
            inv = self.scaler.inv_scale()
            for g in grads:
                g.mul_(inv.to(g.device))
        norm = global_norm(grads) if self.norm_fn is None else self.norm_fn()
        if self.clip_norm is not None:
            factor = clip_factor(norm, self.clip_norm)
            for g in grads:
                g.mul_(factor)
        return norm

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        with torch.no_grad():
            return float(self.eval_fn(tokens, targets))

    def master_params(self) -> Tree:
        return self.params

    def set_lr(self, lr: float) -> None:
        for group in self.opt.param_groups:  # read by the next ``opt.step()``
            group["lr"] = lr

    def state_dict(self) -> dict[str, torch.Tensor]:
        return flat_state(self.named_parameters(), self.opt) | (self.scaler.state_dict() if self.scaler else {})

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        state, scaler_state = split_state(state)
        load_flat_state(self.named_parameters(), self.opt, state)
        if self.scaler is not None:
            self.scaler.load_state_dict(scaler_state)

    def close(self) -> None:
        pass


class PipelineTrainer(AutogradTrainer):
    """This rank's share of a pipeline step; batches are ``[micro-batches * size, ...]``, split here."""

    copy_waits = True

    def __init__(self, pipe: Pipeline, optimizer: torch.optim.Optimizer, n_microbatches: int,
                 clip_norm: float | None = None, scaler: LossScaler | None = None):
        self.pipe, self.n_microbatches = pipe, n_microbatches
        super().__init__(pipe.params, lambda x, y: torch.zeros(()), optimizer, clip_norm=clip_norm,
                         norm_fn=self.pipeline_norm, scaler=scaler)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> StepResult:
        """Time outside the schedule's forward and backward actions (waits for neighbouring stages, the
        bubble, the tied-gradient all-reduce) counts as ``copy_wait_s``."""
        m = self.n_microbatches  # every rank has the loss and the norm: all skip, or none
        self.clock.start()
        self.clock.mark("copy_wait")
        loss = train_step(self.pipe, None, tokens.view(m, -1, *tokens.shape[1:]),
                          targets.view(m, -1, *targets.shape[1:]), timer=self._timed,
                          loss_scale=None if self.scaler is None else self.scaler.scale)
        self.clock.mark("optimizer")
        return self._update(loss, targets, self.clip_grads())

    @contextlib.contextmanager
    def _timed(self, action: Action):
        self.clock.mark("forward" if action.kind == "F" else "backward")
        yield
        self.clock.mark("copy_wait")

    def pipeline_norm(self) -> torch.Tensor:
        """The norm over the whole pipeline: each rank's stages, a tied copy counted on its group's first
        rank only (after the tied all-reduce every copy holds the full gradient)."""
        copies = {path for path, group in self.pipe.tied if dist.get_rank(group) != 0}
        counted = [p.grad for path, p in self.named_parameters() if p.grad is not None and path not in copies]
        return global_norm(counted, self.pipe.ctx.grid.pp_group)

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The batch's loss on every rank, by the training schedule with the gradients thrown away (the
        engine has no forward-only schedule yet: validation costs what a step costs, less the update)."""
        m = self.n_microbatches
        loss = train_step(self.pipe, None, tokens.view(m, -1, *tokens.shape[1:]),
                          targets.view(m, -1, *targets.shape[1:]))
        for p in self.pipe.parameters():
            p.grad = None
        return float(loss)

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return self.pipe.named_parameters()


def flat_state(named: list[tuple[str, torch.Tensor]], opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``param.NAME`` and ``KEY.NAME`` for each tensor in the optimizer's state of that parameter."""
    out = {f"param.{n}": p.detach() for n, p in named}
    for n, p in named:
        for key, value in opt.state.get(p, {}).items():
            out[f"{key}.{n}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return out


def load_flat_state(named: list[tuple[str, torch.Tensor]], opt: torch.optim.Optimizer,
                    state: dict[str, torch.Tensor]) -> None:
    by_name: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in state.items():
        key, name = k.split(".", 1)  # optimizer state keys (step, exp_avg, ...) have no dots
        by_name.setdefault(name, {})[key] = v
    missing = [n for n, _ in named if "param" not in by_name.get(n, {})]
    if missing:
        raise ValueError(f"the saved state lacks {len(missing)} parameters, e.g. {missing[0]}: it is another model's")
    with torch.no_grad():
        for n, p in named:
            saved = by_name[n]
            p.copy_(saved.pop("param"))
            opt.state[p] = {k: v.to(p.device).clone() for k, v in saved.items()}
