"""The ``Trainer`` of a 3D-parallel run: the pipeline's step, its gradients reduced and updated by data parallelism.

Each rank's leaves (its stages, its TP shard) are held by ``data_parallel.DataParallelAdam`` over the
data-parallel group, in the units of ``step.grad_units``: DDP, ZeRO-1 or ZeRO-2 with that engine's
semantics, buckets, fp32 gradients and 8-bit moments. A step:

- the optimizer's weights (ZeRO: the gathered new shards) become the pipeline's leaves, each of whose
  gradients is added, as backward produces it, into the engine's fp32 bucket buffers (zeroed at the step's start:
  a schedule's micro-batches reach a leaf in no fixed order); taking, holding and handing units over are the
  resident trainer's (``core.train.handover``), walked by the schedule;
- the schedule runs on this replica's slice, the loss divided by the *global* batch's count of valid
  targets, so the replicas' summed gradients are exactly the whole batch's however the ignored targets
  (-100) fall between them;
- when a stage's last backward action is done (``on_stage_done``) its unit is final (``final``): the partial
  sums of replicated leaves (sequence-parallel norms, per-head norms: ``tensor_parallel.shard.summed``) are
  summed over TP, a key/value head's rows over the TP ranks sharing it (tp past those heads), and the
  unit goes to the engine (``update``), which starts its bucket's sum over DP at once (the pipeline
  goes on with the other stages' backwards while it runs) and updates it;
- after the schedule, each tied leaf's copies are summed over their pipeline group and are final last.
  All the reductions are sums, so their order does not change the result.

With ``clip_norm`` (clipping) or fp16 (dynamic loss scaling, ``train.scaler``: backward runs from the scaled
loss, each unit is unscaled in fp32 when final) the final units are held until the schedule ends
(``HandOver.OPTIMIZER_AFTER``: the norm is a collective of the whole world, which no rank may enter while its
pipeline neighbours still wait for it) and their updates wait for the whole model's gradient norm, which the
data-parallel engine takes from the reduced gradients with ``_norm``: each parameter once over
every rank (a replicated leaf on the first TP rank, a tied leaf on its first holder, under DDP on the first
replica), the squares summed over the world. fp16 without clipping clips at an infinite norm: a factor of exactly
1, or NaN everywhere when some rank's gradient overflowed, so every rank skips that step whole.

The step-time split (``monitor.steptime``) is this rank's: ``forward_s`` the schedule's F actions (their TP
collectives included), ``backward_s`` its B, I and W actions, ``optimizer_s`` taking the new weights and
handing units over (the reductions' waits and the updates that run then), ``copy_wait_s`` everything else:
waiting for the neighbouring stages (the bubble), the TP sums, the tied sums, the loss broadcast.
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import replace
from typing import Iterator

import torch
import torch.distributed as dist

from nanotrain.data_parallel import DataParallelAdam, DPConfig
from nanotrain.core.train.shard import Piece, ShardState
from nanotrain.monitor.steptime import StepClock
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.optim.offload import resolve_device
from nanotrain.compose.evaluate import forward_loss
from nanotrain.compose.step import Parallel3D, grad_units, replica_slice
from nanotrain.pipeline.executor import run_step
from nanotrain.pipeline.schedule import Action
from nanotrain.pipeline.train import share_loss
from nanotrain.tensor_parallel.grads import sum_partial_grads
from nanotrain.tensor_parallel.shard import counted_pieces
from nanotrain.core.train.clip import clipped_result
from nanotrain.core.train.handover import HandOver, UnitHandOver
from nanotrain.core.train.result import StepResult
from nanotrain.core.train.scaler import LossScaler, split_state
from nanotrain.core.train.step import HoldsOptimizer, Pass, accumulate_fp32, batch_denominator, dropout_seed
from nanotrain.core.tree import tree_map


class Parallel3DTrainer(HoldsOptimizer):
    """This rank's share of a step (see the module docstring); every rank is handed the same global batch. Its
    state and masters are its leaves' (its TP shard; under ZeRO gathered on the first dp rank, collectively)."""

    def __init__(self, p3d: Parallel3D, hp: AdamConfig, ocfg: OffloadConfig, dcfg: DPConfig = DPConfig(),
                 clip_norm: float | None = None):
        if dcfg.zero == 3:
            raise ValueError("ZeRO-3 under 3D parallelism is not built (a pipeline stage would gather its leaves "
                             "per micro-batch); use zero stage 0, 1 or 2")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip norm {clip_norm} must be > 0")
        self.clip_norm, self.scaler = clip_norm, LossScaler() if ocfg.dtype == torch.float16 else None
        held = clip_norm if clip_norm is not None else math.inf if self.scaler else None  # the docstring
        if held is not None and dcfg.zero and p3d.plan.kv_group is not None:
            raise ValueError("clipping or fp16 with ZeRO needs each key/value head's gradient counted once, which a "
                             "shard of a head shared by several TP ranks does not tell: use --zero 0, or a --tp that "
                             "does not exceed the key/value heads")
        pipe = self.pipe = p3d.pipe
        self.p3d, self.dcfg, self.spec = p3d, dcfg, p3d.plan.spec
        self.cfg, self.group, self.grid = self.spec.cfg, dist.group.WORLD, pipe.ctx.grid
        leaves = dict(pipe.named_parameters())
        first = next(iter(leaves.values()))
        if ocfg.dtype != first.dtype or resolve_device(ocfg) != first.device:
            raise ValueError(f"the model computes in {first.dtype} on {first.device} but the optimizer's weights would "
                             f"be {ocfg.dtype} on {ocfg.device}; make OffloadConfig's dtype and device build_3d's")
        self.units, self.starts = grad_units(pipe)
        self.shapes = {path: t.shape for path, t in leaves.items()}
        self.copies = {path for path, group in pipe.tied if dist.get_rank(group) != 0}  # counted by their first holder
        # an update that waits for the norm is skipped whole from its first unit: no second copy of the state
        self.opt = DataParallelAdam(tree_map(lambda t: None if t is None else t.detach(), pipe.params), self.units,
                                    hp, replace(ocfg, exact_skip=ocfg.exact_skip and held is None), self.grid.dp_group,
                                    dcfg, copy=False, clip_norm=held, norm=self._norm)
        self._inv_scale = torch.ones((), dtype=torch.float32, device=first.device)
        self.at = Pass(StepClock(first.device), unscale=self._inv_scale if self.scaler else None)
        self.clock = self.at.clock
        policy = HandOver.choose(self.opt, clip_norm, self.scaler is not None, redoes=False, norm_midway=False)
        self.weights = UnitHandOver(self.opt, self.units, self.at, policy, clip_norm,
                                    functools.partial(sum_partial_grads, plan=p3d.plan))  # over TP, before DP
        self.step_count = 0
        self._take_weights()  # the pipeline computes with the optimizer's weights from now on

    @property
    def layout(self) -> dict:
        grid = self.grid
        return {"tp": grid.tp, "pp": grid.pp, "dp": grid.dp, "zero": self.dcfg.zero}

    def _take_weights(self) -> None:
        """The optimizer's current weights as the pipeline's leaves, whose gradients go into its fp32 buffers."""
        for unit in self.units:
            self.weights.take(self.pipe.params, unit, self._accumulate)

    def _accumulate(self, path: str, leaf: torch.Tensor) -> None:
        if leaf.grad is not None:  # None: a weight whose gradient a zero-bubble I pass deferred to its W pass
            accumulate_fp32([self.weights.accum[path]], [leaf.grad], first=False)
            leaf.grad = None

    def stage_done(self, stage: int) -> None:
        """The pipeline's ``on_stage_done``: the stage's units are final (handed to the engine, or held)."""
        self.clock.mark("optimizer")
        for unit in self.starts.get(stage, ()):
            self.weights.final(unit)
        self.clock.mark("copy_wait")

    def _norm(self, pieces: list[tuple[Piece, torch.Tensor]]) -> torch.Tensor:
        """The whole model's gradient norm from this rank's reduced ``pieces``, on every rank: each parameter counted
        by one rank (the module docstring), the squares summed over the world."""
        plan, grid = self.p3d.plan, self.grid
        counted = []
        if self.dcfg.zero or grid.dp_rank == 0:  # DDP: every replica holds the same sums
            for piece, t in pieces:
                if piece.path in self.copies:
                    continue
                if plan.spec.leaf(piece.path).placement.replicated:  # the same on every TP rank
                    counted += [t] if grid.tp_rank == 0 else []
                else:  # whole leaves (DDP), or flat ranges without shared key/value heads (checked at __init__)
                    whole = t.numel() == self.shapes[piece.path].numel()
                    counted += counted_pieces(piece.path, t.view(self.shapes[piece.path]) if whole else t, plan)
        squares = torch.zeros((), dtype=torch.float32, device=self.opt.device)
        for t in counted:
            squares += torch.linalg.vector_norm(t, dtype=torch.float32).square()
        dist.all_reduce(squares)
        return squares.sqrt()

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> StepResult:
        pipe, grid, scaler = self.pipe, self.grid, self.scaler
        self.clock.start()
        if scaler:
            self._inv_scale.copy_(scaler.inv_scale())
        skipped_before = self.opt.skipped_steps  # exact with fp16: the last step's end waited for its updates
        self.clock.mark("optimizer")
        with pipe.ctx.guard():
            pipe.ctx.where = "taking the new weights"
            self._take_weights()
            for g in self.weights.accum.values():
                g.zero_()
            self.clock.mark("copy_wait")
            m = pipe.schedule.n_microbatches
            denom = batch_denominator(tokens, targets, tokens.shape[0], self.spec, positions)
            # one process's dropout seeds: its micro-batches in batch order, this replica's from grid.dp_rank * m
            seeds = [dropout_seed(self.spec, 0, self.step_count, grid.dp_rank * m + j) for j in range(m)]
            loss = run_step(pipe, replica_slice(tokens, grid, m), replica_slice(targets, grid, m), timer=self._timed,
                            denom=denom, loss_scale=scaler and scaler.scale,
                            on_stage_done=self.stage_done, seeds=seeds,
                            positions=None if positions is None else replica_slice(positions, grid, m))
            pipe.ctx.where = "the tied-gradient sums and the last data-parallel reductions"
            for path, group in pipe.tied:
                dist.all_reduce(self.weights.accum[path], group=group)
            self.clock.mark("optimizer")
            for path, _ in pipe.tied:
                self.weights.final(f"tied.{path}")
            norm = self.weights.finish()
            self.clock.mark("copy_wait")
            pipe.ctx.where = "the loss broadcast"
            share_loss(pipe, loss)
            dist.all_reduce(loss, group=grid.dp_group)
            if self.dcfg.check_replicas:
                self.opt.check_replicas()
            if scaler:
                self.opt.synchronize()
        pipe.ctx.where = "between steps"
        self.step_count += 1
        # fp16: whether the optimizer skipped the step (every rank alike: the norm is the world's)
        result = self.scaled_result(clipped_result(float(loss), denom, norm, self.clip_norm), skipped_before)
        self.clock.mark("end")
        return replace(result, **self.clock.take())

    @contextlib.contextmanager
    def _timed(self, action: Action) -> Iterator[None]:
        self.clock.mark("forward" if action.kind == "F" else "backward")
        yield
        self.clock.mark("copy_wait")

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's leaves with the weights the next step computes with."""
        self._take_weights()
        return self.pipe.named_parameters()

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> float:
        """The global batch's mean loss with the weights the next step computes with, forward only (``evaluate``)."""
        with self.pipe.ctx.guard():
            self.pipe.ctx.where = "taking the new weights"
            self._take_weights()
            denom = batch_denominator(tokens, targets, tokens.shape[0], self.spec, positions)
            loss = forward_loss(self.pipe, tokens, targets, denom, positions)
        self.pipe.ctx.where = "between steps"
        return float(loss)

    def shard_state(self) -> ShardState:
        """This rank's pieces for a sharded checkpoint (a tied leaf's copy written by its first holder), and fp16's
        loss-scaler state (the same on every rank)."""
        state = self.opt.shard_state((self.grid.tp_rank, self.grid.tp))
        state.skip |= {p.name for p in state.pieces if p.path in self.copies}
        state.entries |= self.scaler.state_dict() if self.scaler else {}
        state.group, state.layout = self.group, self.layout
        return state

    def load_shard_state(self, entries: dict[str, torch.Tensor]) -> None:
        shards, scaler = split_state(entries)
        self.opt.load_shard_state(shards)
        if self.scaler:
            self.scaler.load_state_dict(scaler)
