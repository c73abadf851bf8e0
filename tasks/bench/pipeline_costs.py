"""Layer costs measured on the device, for stage balancing that matches what the stages really take.

A model's own costs are FLOP counts. On a GPU they miss what FLOPs do not show: GPT-2-XL's head
with its cross-entropy over 50,257 columns measured about 4 blocks' time for 2.4 blocks' FLOPs,
and the embedding's backward (a dense [vocab, C] gradient per micro-batch) about a block and a
third for none. Timing each layer's forward + backward on one micro-batch fixes the split.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from nanotrain.distributed.context import DistContext
from nanotrain.pipeline.layered import LayeredModel
from nanotrain.core.tree import Tree, set_path


def random_tree(model: LayeredModel, paths: Iterable[str], device: torch.device, dtype: torch.dtype,
                generator: torch.Generator | None = None) -> Tree:
    """``model``'s skeleton with random weights (std 0.02, made on ``device``) at ``paths``, taking gradients."""
    tree = model.skeleton()
    for path in paths:
        t = torch.randn(model.shapes[path], generator=generator, device=device, dtype=torch.float32) * 0.02
        set_path(tree, path, t.to(dtype).requires_grad_())
    return tree


def _seconds(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: kernel selection, allocator
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def measured_costs(model: LayeredModel, inputs: torch.Tensor, targets: torch.Tensor, device: torch.device,
                   dtype: torch.dtype = torch.float32, repeats: int = 3) -> LayeredModel:
    """``model`` with every layer's, the first layer's and the head's cost replaced by the seconds of
    its forward + backward on ``inputs``/``targets`` (one micro-batch), with random weights.

    Layers run one at a time, each holding only its own weights. Timings vary a little between
    runs and ranks: processes must agree on one set (e.g. average them) before partitioning.
    """
    x = inputs.to(device)
    targets = targets.to(device)
    denom = model.denominator(targets)

    def time_layer(apply, paths: tuple[str, ...], x: torch.Tensor) -> tuple[float, torch.Tensor]:
        params = random_tree(model, paths, device, dtype)
        x_in = x.detach().requires_grad_(x.is_floating_point())

        def run() -> None:
            y = apply(params, x_in)
            y.backward(torch.ones_like(y))

        seconds = _seconds(run, device, repeats)
        with torch.no_grad():
            return seconds, apply(params, x_in)

    costs = [0.0]
    if model.first is not None:
        costs[0], x = time_layer(model.first.apply, model.first.paths, x)
    for layer in model.layers:
        cost, x = time_layer(layer.apply, layer.paths, x)
        costs.append(cost)
    head_params = random_tree(model, model.head.paths, device, dtype)
    h = x.detach().requires_grad_()
    costs.append(_seconds(lambda: model.head.loss(head_params, h, targets, denom).backward(), device, repeats))
    return with_costs(model, costs)


def with_costs(model: LayeredModel, costs: list[float]) -> LayeredModel:
    """``model`` with costs ``[first, *layers, head]`` (as flattened by ``cost_list``)."""
    first = dataclasses.replace(model.first, cost=costs[0]) if model.first is not None else None
    layers = tuple(dataclasses.replace(layer, cost=c) for layer, c in zip(model.layers, costs[1:-1], strict=True))
    return dataclasses.replace(model, first=first, layers=layers, head=dataclasses.replace(model.head, cost=costs[-1]))


def cost_list(model: LayeredModel) -> list[float]:
    """``[first, *layers, head]`` costs (first 0 when the model has none), to share between processes."""
    return [model.first.cost if model.first else 0.0, *(layer.cost for layer in model.layers), model.head.cost]


def balance_by_measurement(ctx: DistContext, model: LayeredModel, x: torch.Tensor, y: torch.Tensor,
                           dtype: torch.dtype) -> LayeredModel:
    """The model with its layers' measured costs, averaged over the pipeline's ranks so every rank splits alike.

    ``x``, ``y``: one micro-batch. Collective over ``ctx.grid.pp_group``.
    """
    ctx.where = "measuring layer costs"
    with ctx.guard():
        costs = torch.tensor(cost_list(measured_costs(model, x, y, ctx.device, dtype)), dtype=torch.float64,
                             device=ctx.device)
        dist.all_reduce(costs, group=ctx.grid.pp_group)
    costs = (costs / ctx.grid.pp).tolist()
    if ctx.rank == 0:
        block = sorted(costs[1:-1])[len(costs[1:-1]) // 2]
        print(f"measured forward+backward per micro-batch: first layer {1e3 * costs[0]:.2f} ms, median layer "
              f"{1e3 * block:.2f} ms, head {1e3 * costs[-1]:.2f} ms ({costs[-1] / block:.1f} layers)", flush=True)
    return with_costs(model, costs)
