"""Layer-by-layer weight streaming: fine-tune a model whose weights do not stay on the device.

The step runs layer-major: every micro-batch goes through a block before the next block starts. Then
each unit (embedding, block, head) needs the device only twice a step, however many micro-batches there
are, and its gradient is final the moment its backward over the last micro-batch ends: it is updated
right there and needs no gradient buffer afterwards. One step:

1. forward: for each block, its weights arrive (prefetched on a side stream while the previous block
   computes), every micro-batch runs through it without autograd, and its outputs are kept as the next
   block's inputs (``BoundaryStore``: on the device, or in host memory for the first ``on_host``);
2. head: the final norm and the fused output-matrix loss per micro-batch give the loss and the
   gradient at the top; a non-finite loss skips the step here, before anything is updated;
3. backward, top block first: the block's masters and moments arrive (prefetched), each
   micro-batch's block is recomputed from its kept input (all but its last matmul, which backward
   does not need: ``core.recompute.block_grads``) and back-propagated, the fp32 gradient
   sums over micro-batches, and AdamW updates the unit on the device (``StreamedAdam``) while the
   next block's backward starts.

With clipping (``StreamConfig.clip_norm``) or fp16 (``train.scaler``) the updates wait for the whole
step's gradient norm or overflow: a pass after the backward (``stream.deferred``: how, and its cost).

Device memory is then two blocks' masters, moments and weights, one block's fp32 gradient, the
embedding and head, the kept boundaries and one micro-batch's activations of one block: nothing grows
with the depth but the boundaries. The price is most of one forward per block recomputed (as the
``every`` recompute policy) and the boundaries of the whole batch.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any, Callable

import torch

from nanotrain.stream.boundaries import BoundaryStore, store_for
from nanotrain.core.frozen import frozen_paths
from nanotrain.core.nf4 import NF4Tensor
from nanotrain.core.recompute import BlockFns, block_grads
from nanotrain.core.models import model_spec, run
from nanotrain.core.models.ops import PLAIN
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.stream.optimizer import Start, StreamedAdam  # what the optimizer starts from
from nanotrain.monitor.steptime import StepClock
from nanotrain.stream.deferred import DeferredSteps
from nanotrain.core.train.clip import clipped_result
from nanotrain.core.train.evaluate import place, streamed_eval_loss
from nanotrain.core.train.scaler import LossScaler
from nanotrain.stream.config import StreamConfig
from nanotrain.core.train.result import StepResult
from nanotrain.core.train.step import HoldsOptimizer, accumulate_fp32, batch_denominator, dropout_seed, micro_batches
from nanotrain.core.tree import get_path


class StreamTrainer(DeferredSteps, HoldsOptimizer):
    """The ``Trainer`` interface (``step``, ``master_params``, ``opt``, ``step_count``) with streamed weights.

    ``cfg``: a config of any model family (or its spec). With ``tail=k`` the top k blocks leave the
    layer-major order: after the others' forward, each micro-batch (in passes of ``tail_micro_batch``
    sequences) runs through them and the head with autograd, and back, at once. Their activations live
    for one pass only, so they need no kept inputs and no recompute; their weights and fp32 gradients
    stay on the device for the step, and their updates ride along with the layer-major backward of the
    blocks below, one per block.

    The head's output matrix (``spec.head_weight``) is the embedding unit's when tied (its gradient sums the
    head's and the embedding's), the head unit's when not.
    """

    def __init__(self, cfg: Any, params: Start, scfg: StreamConfig, adam: AdamConfig, ocfg: OffloadConfig,
                 make_opt: Callable[..., StreamedAdam] | None = None):
        spec = self.spec = model_spec(cfg)
        scfg.check(spec)
        self.cfg, self.scfg = spec.cfg, scfg
        self.units = spec.unit_dict()
        # ``make_opt(params, units, adam, ocfg)``: an optimizer with StreamedAdam's interface (a sharded one
        # under data parallelism: ``nanotrain.stream.sharded``)
        frozen, nf4 = frozen_paths(spec, ocfg.base_bits)  # a base under adapters travels with its units
        self.opt = (make_opt or functools.partial(StreamedAdam, frozen=frozen, nf4=nf4))(params, self.units, adam, ocfg)
        self.device = self.opt.device
        self.block_names = [u.name for u in spec.block_units]
        self.embed_slot = self.opt.new_slot(spec.embed_unit.name)
        self.head_slot = self.opt.new_slot(spec.head_unit.name)
        self.block_slots = [self.opt.new_slot(self.block_names[0]) for _ in range(2)]
        self.block_keys = spec.block_keys
        shapes = [w.shape for w in self.block_slots[0].weights if w.requires_grad]  # trained leaves' gradients
        self.block_grads = [torch.empty(sh, dtype=torch.float32, device=self.device) for sh in shapes]
        self.first_tail = spec.n_layer - scfg.tail
        self.tail_weights = [[w.empty_like() if isinstance(w, NF4Tensor) else torch.empty_like(w).requires_grad_(
            w.requires_grad) for w in self.block_slots[0].weights] for _ in range(scfg.tail)]
        self.tail_grads = [[torch.empty(sh, dtype=torch.float32, device=self.device) for sh in shapes]
                           for _ in range(scfg.tail)]
        self.tail_slot = self.opt.new_slot(self.block_names[0]) if scfg.tail else None
        self.fns = BlockFns.compiled(scfg.compile)  # the block, and what its backward recomputes
        self.accumulate = torch.compile(accumulate_fp32, dynamic=False) if scfg.compile else accumulate_fp32
        self._store: BoundaryStore | None = None
        self.step_count = 0
        self.first_micro = 0  # this batch's first micro-batch's index in the global batch (for dropout seeds)
        self.clock = StepClock(self.device)
        self.opt.clock.steps = self.clock  # its copy waits are a phase of the step's split
        self.scaler = LossScaler() if ocfg.dtype == torch.float16 else None
        # Clipping and fp16 need the whole step's gradients before any update (train.deferred).
        deferred = scfg.clip_norm is not None or self.scaler is not None
        self.kept = self.opt.kept_grads(self.block_names[:self.first_tail]) if deferred else None
        self._inv_scale = torch.ones((), dtype=torch.float32, device=self.device)

    def _block_slot(self, i: int):
        return self.block_slots[i % 2]

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None,
             denom: int | None = None) -> StepResult:
        """Forward+backward over ``tokens``/``targets`` ([batch, seq], on the CPU; packed rows with their ``positions``)
        and the AdamW step. ``denom``: the loss's denominator when this batch is one part of a larger one (DP)."""
        scfg, opt = self.scfg, self.opt
        self.clock.start()
        if self.scaler is not None:
            self._inv_scale.copy_(self.scaler.inv_scale())
        count = batch_denominator(tokens, targets, scfg.batch, self.spec, positions)  # checks the shapes and tokens too
        denom = denom or count
        toks, tgts, self._pos = zip(*micro_batches(scfg.micro_batch, self.device, tokens, targets, positions))
        self._ops = [PLAIN.packed(pos) for pos in self._pos]  # each micro-batch's op set (packed: its documents)
        seeds = [dropout_seed(self.spec, scfg.dropout_seed, self.step_count, self.first_micro + m)
                 for m in range(len(toks))]
        shape = (scfg.micro_batch, tokens.shape[1], self.spec.costs.width)  # the host arena is locked once a shape
        store = self._store = store_for(self._store, self.first_tail, len(toks), shape, self.opt.cfg.dtype,
                                        self.device, scfg.on_host, self.opt.clock)
        tree = run.empty_tree(self.spec)
        loss, grad_x, grads = self._forward_and_head(toks, tgts, denom, seeds, store, tree)
        skipped, norm = not math.isfinite(loss), None  # norm: of a deferred step
        if not skipped:
            self._backward(toks, seeds, store, grad_x, tree, grads)
        if self.kept is not None and not skipped:
            norm = self._verdict(grads)
            skipped = not math.isfinite(norm)
        opt.finish_step(skipped)
        self.step_count += 1
        self.clock.mark("end")
        # copy waits: opt.clock times them there; fp16's scale moved as the resident trainer moves it
        result = replace(clipped_result(loss, denom, norm, scfg.clip_norm), **self.clock.take())
        return result if self.scaler is None else self.scaler.record(result)

    def _forward_and_head(self, toks, tgts, denom, seeds, store, tree):
        """The layer-major forward, then the tail and the head per pass: the loss, each micro-batch's gradient
        at the top layer-major block's output, and the fp32 gradients of the head's leaves by path."""
        spec, opt, below, names = self.spec, self.opt, self.first_tail, self.block_names
        tails = iter(range(below, spec.n_layer))
        opt.fetch(spec.embed_unit.name, self.embed_slot)
        if below:
            opt.fetch(names[0], self._block_slot(0))
        place(opt, tree, spec.embed_unit, self.embed_slot)
        with torch.no_grad():
            xs = [spec.embed(tree, t, o, s) for t, s, o in zip(toks, seeds, self._ops)]
            for i in range(below):
                if i + 1 < below:
                    opt.fetch(names[i + 1], self._block_slot(i + 1))
                # A tail block's weights travel while a block below computes: loaded on their own,
                # with nothing to compute meanwhile, each made the device wait for its copy.
                tail = next(tails, None)
                if tail is not None:
                    opt.fetch(names[tail], self.tail_slot)
                slot = self._block_slot(i)
                p = dict(zip(self.block_keys, opt.weights(slot)))
                for m, x in enumerate(xs):
                    store.put(i, m, x)
                    xs[m] = self.fns.block(spec, p, x, self._ops[m], run.block_seed(seeds[m], i))
                opt.release(slot)
                if tail is not None:
                    self._keep_tail(tail)
            for tail in tails:  # more tail blocks than blocks below them
                opt.fetch(names[tail], self.tail_slot)
                self._keep_tail(tail)
        opt.fetch(spec.head_unit.name, self.head_slot, states=True)
        # The top layer-major block goes back first: its moments travel during the head (its
        # masters are still in its slot from the forward pass, so ``fetch`` copies only those).
        if below:
            opt.fetch(names[below - 1], self._block_slot(below - 1), states=self.kept is None)
        place(opt, tree, spec.head_unit, self.head_slot)
        trained = [path for path in spec.head_paths() if spec.leaf(path).trainable]
        head_w = [get_path(tree, path) for path in trained]
        grads = {path: torch.zeros_like(w, dtype=torch.float32) for path, w in zip(trained, head_w)}
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        grad_x = []
        tail_w = [w for ws in self.tail_weights for w in ws if w.requires_grad]
        size = self.scfg.tail_micro_batch or self.scfg.micro_batch
        for m, (xm, tm) in enumerate(zip(xs, tgts)):
            pieces = []
            pos = self._pos[m].split(size) if self._pos[m] is not None else [None] * len(xm.split(size))
            for n, (x, t, ops) in enumerate(zip(xm.split(size), tm.split(size), map(PLAIN.packed, pos))):
                self.clock.mark("forward")
                x = h = x.detach().requires_grad_()
                for j, ws in enumerate(self.tail_weights):
                    p = dict(zip(self.block_keys, ws))
                    h = self.fns.block(spec, p, h, ops, run.block_seed(seeds[m], below + j))
                loss = run.head_loss(spec, tree, h, t, ops, denom, self.scfg.chunk_tokens)
                self.clock.mark("backward")
                scaled = loss if self.scaler is None else loss * self.scaler.scale
                gx, *gw = torch.autograd.grad(scaled, [x, *head_w, *tail_w])
                pieces.append(gx)
                self.accumulate(list(grads.values()), gw[:len(head_w)], False)
                if tail_w:
                    self.accumulate([a for accs in self.tail_grads for a in accs], gw[len(head_w):], m == n == 0)
                total += loss.detach()
            grad_x.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
            xs[m] = None
        loss = opt.step_loss(total)  # the one host sync of the step, before anything is updated
        head_grads = [grads[path] for path in spec.head_unit.paths if path in grads]
        if math.isfinite(loss) and not head_grads:  # a frozen head
            opt.release(self.head_slot)
        elif math.isfinite(loss) and self.kept is not None:
            self._final_head(head_grads)
            opt.release(self.head_slot)
        elif math.isfinite(loss):
            self._update(self.head_slot, head_grads)
            for path in spec.head_unit.paths:  # updated: an untied head's fp32 gradient (2 GiB for a 128k
                grads.pop(path, None)            # vocabulary) need not outlive the blocks' backward
        else:
            opt.release(self.head_slot)
            for slot in self.block_slots:
                opt.release(slot)
            opt.release(self.embed_slot)
        return loss, grad_x, grads

    def _keep_tail(self, index: int) -> None:
        """Copy tail block ``index``, loaded into the tail slot, into its weights kept for the step."""
        with torch.no_grad():
            for keep, w in zip(self.tail_weights[index - self.first_tail], self.opt.weights(self.tail_slot)):
                keep.copy_(w)
        self.opt.release(self.tail_slot)

    def _update(self, slot, grads: list[torch.Tensor]) -> None:
        """The overlapped step's update of one unit, timed as the optimizer's."""
        self.clock.mark("optimizer")
        self.opt.update(slot, grads)
        self.clock.mark("backward")

    def _backward(self, toks, seeds, store, grad_x, tree, grads):
        """Blocks top-down, the tail's updates beside them, then the embedding's backward, whose gradients
        join ``grads`` (where a tied head weight's holds the head's part already)."""
        spec, opt, deferred, names = self.spec, self.opt, self.kept is not None, self.block_names
        self.clock.mark("backward")
        # Tail updates, one per block below (deferred: all after the backward).
        pending = [] if deferred else list(reversed(range(self.first_tail, spec.n_layer)))
        for i in reversed(range(self.first_tail)):
            tail = pending.pop(0) if pending else None
            if tail is not None:
                opt.fetch(names[tail], self.tail_slot, states=True)
            if i > 0:
                opt.fetch(names[i - 1], self._block_slot(i - 1), states=not deferred)
                store.prefetch(i - 1)
            else:
                opt.fetch(spec.embed_unit.name, self.embed_slot, states=not deferred)
            slot = self._block_slot(i)
            p = dict(zip(self.block_keys, opt.weights(slot)))
            for m in range(len(toks)):
                x = store.get(i, m).detach().requires_grad_()
                gx, gws = block_grads(spec, p, x, grad_x[m], run.block_seed(seeds[m], i), self.fns, self._ops[m])
                grad_x[m] = gx
                store.drop(i, m)
                if deferred and m == 0:
                    self.kept.reusable()  # the last block's gradients are copied out of the buffer
                self.accumulate(self.block_grads, [g for g in gws.values() if g is not None], m == 0)
            if deferred:
                self._final_block(i, slot)
            else:
                self._update(slot, self.block_grads)
            if tail is not None:
                self._update(self.tail_slot, self.tail_grads[tail - self.first_tail])
        for tail in pending:  # more tail blocks than blocks below them
            opt.fetch(names[tail], self.tail_slot, states=True)
            self._update(self.tail_slot, self.tail_grads[tail - self.first_tail])
        if not self.first_tail:
            opt.fetch(spec.embed_unit.name, self.embed_slot, states=not deferred)
        paths = [path for path in spec.embed_unit.paths if spec.leaf(path).trainable]
        if not paths:  # a frozen embedding
            return opt.release(self.embed_slot)
        weights = [get_path(tree, path) for path in paths]
        for path, w in zip(paths, weights):
            grads.setdefault(path, torch.zeros_like(w, dtype=torch.float32))
        embed_grads = [grads[path] for path in paths]
        for m, (t, s) in enumerate(zip(toks, seeds)):
            x = spec.embed(tree, t, self._ops[m], s)
            gs = torch.autograd.grad(x, weights, grad_x[m])
            grad_x[m] = None
            self.accumulate(embed_grads, gs, False)
        if deferred:
            self._final(spec.embed_unit.name, embed_grads)
            opt.release(self.embed_slot)
        else:
            self._update(self.embed_slot, embed_grads)

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> float:
        """The batch's mean loss without gradients or dropout (one streamed forward, see ``train.evaluate``)."""
        return streamed_eval_loss(self, tokens, targets, positions)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
        if self.kept is not None:
            self.kept.close()
        self.opt.close()
