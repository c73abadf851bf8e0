"""The pipeline benchmark's peer: our model's stages under ``torch.distributed.pipelining``'s schedules.

Same stage functions, split, weights and micro-batches as ours; the last stage's loss is our head
with its logits kept, and the tied embedding's gradient is summed after the step as ours is.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from nanotrain.core.models import ModelSpec
from nanotrain.core.models.ops import PLAIN
from nanotrain.pipeline import LayeredModel, StageSpec, build_schedule, partition
from nanotrain.pipeline.build import tied_groups
from nanotrain.core.tree import Tree, get_path, set_path

TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
         "zb-h1": "ScheduleInterleavedZeroBubble"}


class TorchStage(nn.Module):
    """One of our stages as an nn.Module over the same weight storage, for torch's engine.

    The last stage ends with the model's final norm; torch's schedule then applies the head's loss (the
    output matrix, tied or not, and cross-entropy) as its ``loss_fn``. Torch's zero-bubble schedule frees
    stage outputs after the input-gradient pass, so a loss_fn must not need its input saved.
    """

    def __init__(self, spec: StageSpec, params: Tree, skeleton: Tree, model_spec: ModelSpec):
        super().__init__()
        self.spec, self.model_spec = dataclasses.replace(spec, head=None), model_spec
        self.weights = nn.ParameterDict()
        self.tree = skeleton
        for path in sorted(spec.paths()):
            p = nn.Parameter(get_path(params, path).detach())
            self.weights[path.replace(".", "__")] = p
            set_path(self.tree, path, p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.spec.forward(self.tree, x)
        return self.model_spec.final_norm(self.tree, x) if self.spec.is_last else x


def torch_pipeline_step(ctx, models: dict[int, LayeredModel], model_spec: ModelSpec, name: str, args,
                        params: dict[int, Tree], x: torch.Tensor,
                        y: torch.Tensor) -> tuple[Callable[[object], None], int]:
    """This rank's step of torch's schedule for our ``name`` (and its stage count), on our stages: ``models`` and
    ``params`` hold the split and this rank's weights by stage count."""
    from torch.distributed import pipelining  # lazily: only this comparison needs it

    p = ctx.world_size
    # Our schedule's stages (ZB-H1 is the one-stage-per-rank case of torch's interleaved zero-bubble schedule).
    schedule = build_schedule(name, p, args.microbatches, args.virtual_stages)
    n_stages = schedule.n_stages
    model = models[n_stages]
    specs = partition(model, n_stages)
    mine = list(range(ctx.rank, n_stages, p))
    modules = [TorchStage(specs[s], params[n_stages], model.skeleton(), model_spec) for s in mine]
    stages = [pipelining.PipelineStage(m, s, n_stages, ctx.device) for m, s in zip(modules, mine, strict=True)]
    last = modules[-1] if mine[-1] == n_stages - 1 else None
    denom = float(y.numel())
    # Torch's split backward (zb-h1) keeps the autograd node where the tied head weight meets the
    # activations, here head_loss's custom Function node, for its W pass, then detach_()es the loss.
    # Before torch 2.13 (seen on 2.11) the Python handle of a custom Function's node holds it only
    # weakly, so the node dies with the loss and the W pass fails: "Attribute '_input_metadata' is
    # invalid" (pytorch/pytorch#166577). So torch gets a clone of the loss, and we hold the original
    # (so the node) until the node's second run, the W pass: same loss kernel, and the lifetime 2.13
    # gives that node.
    held: dict[int, torch.Tensor] = {}
    keys = itertools.count()

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        w = last.tree[last.model_spec.head_weight]
        loss = PLAIN.head_loss(out, w, target, denom, keep_logits=True)  # as our last stage
        if name != "zb-h1":
            return loss
        key, runs = next(keys), []
        held[key] = loss

        def release(grad_inputs, grad_outputs):  # holds no tensor: no reference cycle through the node
            runs.append(None)
            if len(runs) == 2:  # I pass, then W pass
                held.pop(key, None)

        loss.grad_fn.register_hook(release)
        return loss.clone()

    cls = getattr(pipelining, TORCH[name])
    multi = name in ("interleaved-1f1b", "zb-h1")
    sched = cls(stages if multi else stages[0], args.microbatches, loss_fn=loss_fn, scale_grads=False)
    inputs = x.flatten(0, 1).to(ctx.device)
    targets = y.flatten(0, 1).to(ctx.device)

    # The same model as ours: the embedding and the tied head share one gradient, summed over the
    # first and last rank after the step, as our train_step does (torch's schedules leave it out).
    tied = [(get_path(m.tree, path), group) for path, group in tied_groups(specs, schedule, ctx.grid)
            for m in modules if path.replace(".", "__") in m.weights]

    def step(timer):
        kwargs = {"target": targets} if last is not None else {}
        sched.step(*((inputs,) if 0 in mine else ()), **kwargs)
        held.clear()  # every W pass has run by now; this only guards against a leak
        for weight, group in tied:
            dist.all_reduce(weight.grad, group=group)

    return step, n_stages
