"""Layer-by-layer weight streaming: fine-tune a model whose weights do not stay on the device.

The step runs layer-major: every micro-batch goes through a block before the next block starts.
Then each unit (embeddings, block, final norm) needs the device only twice a step, however many
micro-batches there are, and its gradient is final the moment its backward pass over the last
micro-batch ends, so it is updated right there and needs no gradient buffer afterwards. One step:

1. forward: for each block, its weights arrive (prefetched on a side stream while the previous
   block computes), every micro-batch runs through it without autograd, and its outputs are kept
   as the next block's inputs (``BoundaryStore``: on the device, or in host memory for the first
   ``on_host`` boundaries);
2. head: the final norm and the fused LM-head loss per micro-batch give the loss and the gradient
   at the top; a non-finite loss skips the step here, before anything is updated;
3. backward, top block first: the block's masters and moments arrive (prefetched), each
   micro-batch's block is recomputed from its kept input (all but its last matmul, which backward
   does not need: ``checkpointing.block_grads``) and back-propagated, the fp32 gradient
   sums over micro-batches, and AdamW updates the unit on the device (``StreamedAdam``) while the
   next block's backward starts.

With clipping (``StreamConfig.clip_norm``) or fp16 (``train.scaler``) the updates wait for the whole
step's gradient norm or overflow: a pass after the backward (``train.deferred``: how, and its cost).

Device memory is then two blocks' masters, moments and weights, one block's fp32 gradient, the
embeddings, the kept boundaries and one micro-batch's activations of one block: nothing grows with
the depth but the boundaries. The price is most of one forward per block recomputed (as ``every``
checkpointing) and the boundaries of the whole batch.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from nanotrain import model as M
from nanotrain.memory.boundaries import BoundaryStore
from nanotrain.memory.recompute import block_grads
from nanotrain.models.gpt2 import GPT2Config
from nanotrain.optim import AdamConfig, OffloadConfig, gpt2_units
from nanotrain.optim.streamed import StreamedAdam
from nanotrain.monitor.steptime import StepClock
from nanotrain.train.deferred import DeferredSteps
from nanotrain.train.evaluate import streamed_eval_loss
from nanotrain.train.scaler import LossScaler
from nanotrain.train.stream_config import StreamConfig
from nanotrain.train.step import HoldsOptimizer, StepResult, accumulate_fp32, batch_denominator, dropout_seed
from nanotrain.tree import Tree


class StreamTrainer(DeferredSteps, HoldsOptimizer):
    """The ``Trainer`` interface (``step``, ``master_params``, ``opt``, ``step_count``) with streamed weights.

    With ``tail=k`` the top k blocks leave the layer-major order: after the others' forward, each
    micro-batch (in passes of ``tail_micro_batch`` sequences) runs through them and the head with
    autograd, and back, at once. Their activations live for one pass only, so they need no kept
    inputs and no recompute; their weights and fp32 gradients stay on the device for the step, and
    their updates ride along with the layer-major backward of the blocks below, one per block.
    """

    def __init__(self, cfg: GPT2Config, params: Tree, scfg: StreamConfig, adam: AdamConfig, ocfg: OffloadConfig,
                 make_opt: Callable[..., StreamedAdam] | None = None):
        if scfg.tail > cfg.n_layer:
            raise ValueError(f"tail={scfg.tail}: the model has only {cfg.n_layer} blocks")
        if scfg.on_host > cfg.n_layer - scfg.tail:
            raise ValueError(f"on_host={scfg.on_host}: the model keeps only {cfg.n_layer - scfg.tail} block inputs "
                             f"({cfg.n_layer} blocks, {scfg.tail} of them in the tail)")
        if cfg.has_dropout and (scfg.tail_micro_batch or scfg.micro_batch) != scfg.micro_batch:
            raise ValueError("with dropout the tail runs whole micro-batches (a dropout mask is drawn per "
                             "micro-batch): leave tail_micro_batch unset")
        self.cfg, self.scfg = cfg, scfg
        self.units = gpt2_units(cfg)
        # ``make_opt(params, units, adam, ocfg)``: an optimizer with StreamedAdam's interface (a sharded one
        # under data parallelism: ``nanotrain.data_parallel.streamed``)
        self.opt = (make_opt or StreamedAdam)(params, self.units, adam, ocfg)
        self.device = self.opt.device
        self.embed_slot = self.opt.new_slot("embed")
        self.ln_f_slot = self.opt.new_slot("ln_f")
        self.block_slots = [self.opt.new_slot("blocks.0") for _ in range(2)]
        self.block_keys = [p.rsplit(".", 1)[1] for p in self.units["blocks.0"]]
        self.block_grads = [torch.empty(w.shape, dtype=torch.float32, device=self.device)
                            for w in self.block_slots[0].weights]
        self.first_tail = cfg.n_layer - scfg.tail
        shapes = [w.shape for w in self.block_slots[0].weights]
        self.tail_weights = [[torch.empty(sh, dtype=ocfg.dtype, device=self.device).requires_grad_() for sh in shapes]
                             for _ in range(scfg.tail)]
        self.tail_grads = [[torch.empty(sh, dtype=torch.float32, device=self.device) for sh in shapes]
                           for _ in range(scfg.tail)]
        self.tail_slot = self.opt.new_slot("blocks.0") if scfg.tail else None
        self.block_fn = torch.compile(M.block, dynamic=False) if scfg.compile else M.block
        self.trunk_fn = torch.compile(M.block_trunk, dynamic=False) if scfg.compile else M.block_trunk
        self.accumulate = torch.compile(accumulate_fp32, dynamic=False) if scfg.compile else accumulate_fp32
        self._store: BoundaryStore | None = None
        self.step_count = 0
        self.first_micro = 0  # this batch's first micro-batch's index in the global batch (for dropout seeds)
        self.clock = StepClock(self.device)
        self.opt.clock.steps = self.clock  # its copy waits are a phase of the step's split
        self.scaler = LossScaler() if ocfg.dtype == torch.float16 else None
        # Clipping and fp16 need the whole step's gradients before any update (train.deferred).
        deferred = scfg.clip_norm is not None or self.scaler is not None
        self.kept = self._kept_grads(shapes) if deferred else None
        self._inv_scale = torch.ones((), dtype=torch.float32, device=self.device)

    def _seed(self, micro: int) -> int | None:
        return dropout_seed(self.cfg, self.scfg.dropout_seed, self.step_count, self.first_micro + micro)

    def _block_slot(self, i: int):
        return self.block_slots[i % 2]

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, denom: int | None = None) -> StepResult:
        """Forward+backward over ``tokens``/``targets`` ([batch, seq], on the CPU) and the AdamW step.
        ``denom``: the loss's denominator when this batch is one part of a larger one (data parallelism)."""
        cfg, scfg, opt = self.cfg, self.scfg, self.opt
        self.clock.start()
        if self.scaler is not None:
            self._inv_scale.copy_(self.scaler.inv_scale())
        count = batch_denominator(tokens, targets, scfg.batch, cfg)  # checks the shapes and tokens too
        denom = denom or count
        pin = self.device.type == "cuda"
        toks, tgts = ([m.pin_memory().to(self.device, non_blocking=True) if pin else m
                       for m in whole.split(scfg.micro_batch)] for whole in (tokens, targets))
        n_micro = len(toks)
        seeds = [self._seed(m) for m in range(n_micro)]
        block_seed = lambda m, i: None if seeds[m] is None else seeds[m] + 1 + i  # noqa: E731
        store = self._boundaries(n_micro, tokens.shape[1])
        loss, grad_x, embed_w, grads = self._forward_and_head(toks, tgts, denom, seeds, block_seed, store)
        skipped, norm = not math.isfinite(loss), None  # norm: of a deferred step
        if not skipped:
            self._backward(toks, seeds, block_seed, store, grad_x, embed_w, grads)
        if self.kept is not None and not skipped:
            norm = self._verdict(grads)
            skipped = not math.isfinite(norm)
        opt.finish_step(skipped)
        self.step_count += 1
        self.clock.mark("end")
        result = StepResult(loss, skipped, denom, **self.clock.take())  # copy waits: opt.clock times them there
        return self._scaled_result(result, norm)

    def _boundaries(self, n_micro: int, seq: int) -> BoundaryStore:
        """The boundary store for this shape, made once (its host arena is locked once)."""
        shape = (self.scfg.micro_batch, seq, self.cfg.n_embd)
        if self._store is None or self._store.shape != shape:
            if self._store is not None:
                self._store.close()
            self._store = BoundaryStore(self.first_tail, n_micro, shape, self.opt.cfg.dtype, self.device,
                                        self.scfg.on_host, self.opt.clock)
        self._store.reset()
        return self._store

    def _forward_and_head(self, toks, tgts, denom, seeds, block_seed, store):
        cfg, opt, below = self.cfg, self.opt, self.first_tail
        tails = iter(range(below, cfg.n_layer))
        opt.load("embed", self.embed_slot)
        if below:
            opt.load("blocks.0", self._block_slot(0))
        wte, wpe = opt.weights(self.embed_slot)
        embed_w = {"wte": wte, "wpe": wpe}
        with torch.no_grad():
            xs = [M.embed(embed_w, t, cfg, s) for t, s in zip(toks, seeds)]
            for i in range(below):
                if i + 1 < below:
                    opt.load(f"blocks.{i + 1}", self._block_slot(i + 1))
                # A tail block's weights travel while a block below computes: loaded on their own,
                # with nothing to compute meanwhile, each made the device wait for its copy.
                tail = next(tails, None)
                if tail is not None:
                    opt.load(f"blocks.{tail}", self.tail_slot)
                slot = self._block_slot(i)
                p = dict(zip(self.block_keys, opt.weights(slot)))
                for m, x in enumerate(xs):
                    store.put(i, m, x)
                    xs[m] = self.block_fn(p, x, cfg, block_seed(m, i))
                opt.release(slot)
                if tail is not None:
                    self._keep_tail(tail)
            for tail in tails:  # more tail blocks than blocks below them
                opt.load(f"blocks.{tail}", self.tail_slot)
                self._keep_tail(tail)
        opt.load("ln_f", self.ln_f_slot, states=True)
        # The top layer-major block goes back first: its moments travel during the head (its
        # masters are still in its slot from the forward pass, so ``load`` copies only those).
        if below:
            opt.load(f"blocks.{below - 1}", self._block_slot(below - 1), states=self.kept is None)
        ln_w = opt.weights(self.ln_f_slot)
        ln_f = dict(zip(("ln_f_w", "ln_f_b"), ln_w))
        ln_grads = [torch.zeros(w.shape, dtype=torch.float32, device=self.device) for w in ln_w]
        wte_grad = torch.zeros(wte.shape, dtype=torch.float32, device=self.device)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        grad_x = []
        tail_w = [w for ws in self.tail_weights for w in ws]
        size = self.scfg.tail_micro_batch or self.scfg.micro_batch
        for m, (xm, tm) in enumerate(zip(xs, tgts)):
            pieces = []
            for n, (x, t) in enumerate(zip(xm.split(size), tm.split(size))):
                self.clock.mark("forward")
                x = x.detach().requires_grad_()
                h = x
                for j, ws in enumerate(self.tail_weights):
                    h = self.block_fn(dict(zip(self.block_keys, ws)), h, cfg, block_seed(m, self.first_tail + j))
                loss = M.head_loss({"wte": wte}, M.final_norm(ln_f, h, cfg), t, denom=denom,
                                   chunk_tokens=self.scfg.chunk_tokens)
                self.clock.mark("backward")
                scaled = loss if self.scaler is None else loss * self.scaler.scale
                gx, gw, gb, gwte, *gtail = torch.autograd.grad(scaled, [x, *ln_w, wte, *tail_w])
                pieces.append(gx)
                self.accumulate([*ln_grads, wte_grad], [gw, gb, gwte], False)
                if gtail:
                    self.accumulate([a for accs in self.tail_grads for a in accs], gtail, m == n == 0)
                total += loss.detach()
            grad_x.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
            xs[m] = None
        loss = opt.step_loss(total)  # the one host sync of the step, before anything is updated
        if math.isfinite(loss) and self.kept is not None:
            self._final_head(ln_grads)
            opt.release(self.ln_f_slot)
        elif math.isfinite(loss):
            self._update(self.ln_f_slot, ln_grads)
        else:
            opt.release(self.ln_f_slot)
            for slot in self.block_slots:
                opt.release(slot)
            opt.release(self.embed_slot)
        return loss, grad_x, embed_w, {"ln_f": ln_grads, "wte": wte_grad}

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

    def _backward(self, toks, seeds, block_seed, store, grad_x, embed_w, grads):
        cfg, opt, deferred = self.cfg, self.opt, self.kept is not None
        self.clock.mark("backward")
        # Tail updates, one per block below (deferred: all after the backward).
        pending = [] if deferred else list(reversed(range(self.first_tail, cfg.n_layer)))
        for i in reversed(range(self.first_tail)):
            tail = pending.pop(0) if pending else None
            if tail is not None:
                opt.load(f"blocks.{tail}", self.tail_slot, states=True)
            if i > 0:
                opt.load(f"blocks.{i - 1}", self._block_slot(i - 1), states=not deferred)
                store.prefetch(i - 1)
            else:
                opt.load("embed", self.embed_slot, states=not deferred)
            slot = self._block_slot(i)
            ws = opt.weights(slot)
            p = dict(zip(self.block_keys, ws))
            for m in range(len(toks)):
                x = store.get(i, m).detach().requires_grad_()
                gx, gws = block_grads(p, x, grad_x[m], cfg, block_seed(m, i), self.trunk_fn)
                grad_x[m] = gx
                store.drop(i, m)
                if deferred and m == 0:
                    self.kept.reusable()  # the last block's gradients are copied out of the buffer
                self.accumulate(self.block_grads, list(gws.values()), m == 0)
            if deferred:
                self._final_block(i, slot)
            else:
                self._update(slot, self.block_grads)
            if tail is not None:
                self._update(self.tail_slot, self.tail_grads[tail - self.first_tail])
        for tail in pending:  # more tail blocks than blocks below them
            opt.load(f"blocks.{tail}", self.tail_slot, states=True)
            self._update(self.tail_slot, self.tail_grads[tail - self.first_tail])
        if not self.first_tail:
            opt.load("embed", self.embed_slot, states=not deferred)
        wte, wpe, wte_grad = embed_w["wte"], embed_w["wpe"], grads["wte"]
        wpe_grad = torch.zeros(wpe.shape, dtype=torch.float32, device=self.device)
        for m, (t, s) in enumerate(zip(toks, seeds)):
            x = M.embed(embed_w, t, cfg, s)
            gwte, gwpe = torch.autograd.grad(x, [wte, wpe], grad_x[m])
            grad_x[m] = None
            self.accumulate([wte_grad, wpe_grad], [gwte, gwpe], False)
        grads["embed"] = [wte_grad, wpe_grad]
        if deferred:
            self._final("embed", grads["embed"])
            opt.release(self.embed_slot)
        else:
            self._update(self.embed_slot, grads["embed"])

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The batch's mean loss without gradients or dropout (one streamed forward, see ``train.evaluate``)."""
        return streamed_eval_loss(self, tokens, targets)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
        if self.kept is not None:
            self.kept.close()
        self.opt.close()
