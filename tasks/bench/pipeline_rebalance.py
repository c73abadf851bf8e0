"""Profile-guided stage balance: layer costs corrected by what each stage takes in the running pipeline.

Layers timed one at a time (``costs.measured_costs``) misjudge what they cost inside the
pipeline, attention and MLP sublayers most: on gpt2-xl the four stages came out about 3% apart,
and the slowest stage sets the pace of all of them. The pipeline itself times each stage
(``clock.ActionClock``); those times correct the costs, and the model is split again.
"""
from __future__ import annotations

from typing import Callable, Sequence

from tasks.bench.pipeline_costs import cost_list, with_costs
from nanotrain.pipeline.layered import LayeredModel, StageSpec, partition

MIN_GAIN = 0.002  # a new split must predict its slowest stage this much (relative) faster to be tried


def imbalance(stage_times: Sequence[float]) -> float:
    """Slowest stage over the mean: 1.0 is a perfect split, 1.03 a pipeline paced 3% above it."""
    return max(stage_times) * len(stage_times) / sum(stage_times)


def refine_costs(model: LayeredModel, specs: Sequence[StageSpec], stage_ms: Sequence[float]) -> LayeredModel:
    """``model`` with the costs of each stage's layers (first layer and head included) scaled so
    that they add up to ``stage_ms``, that stage's measured compute per micro-batch.

    ``specs`` must be ``partition(model, len(specs))``'s split. A stage time is one number and
    cannot tell which of its layers was misjudged, so the layers keep their relative costs (what
    the isolated timings know) and share the stage's correction. The costs are then in ms.

    Convergence: the update is not damped. After it, the current split's predicted stage times
    are exactly the measured ones, so a new split is judged against reality everywhere but on
    the layers it moves across a boundary, which carry their old stage's factor. That error is
    a factor's error times the moved layers' share of a stage: small from isolated timings, and
    the next round measures those layers in their new stage. From far-off guesses (FLOP counts:
    gpt2-xl's head takes 1.7x its FLOPs' share) the moved layers look too dear, too few move, and
    each round closes part of the gap. Damping would slow that and leave the current split
    mispredicted. What stops oscillation is ``rebalance``'s rule: split again only for a gain.
    """
    if len(stage_ms) != len(specs):
        raise ValueError(f"got {len(stage_ms)} stage times for {len(specs)} stages")
    if [layer.name for spec in specs for layer in spec.layers] != [layer.name for layer in model.layers]:
        raise ValueError("the stages do not split this model's layers; pass partition(model, n_stages) of the "
                         "model whose costs are refined")
    costs = cost_list(model)  # [first, *layers, head]
    start = 1
    for spec, ms in zip(specs, stage_ms, strict=True):
        if ms <= 0 or spec.cost <= 0:
            raise ValueError(f"stage {spec.index} has measured time {ms} and predicted cost {spec.cost}; both must be "
                             f"positive to rescale its layers (time the stage's actions, or give its layers costs)")
        members = list(range(start, start + len(spec.layers)))
        members += ([0] if spec.first else []) + ([len(costs) - 1] if spec.head else [])
        for i in members:
            costs[i] *= ms / spec.cost
        start += len(spec.layers)
    return with_costs(model, costs)


def rebalance(model: LayeredModel, n_stages: int, measure: Callable[[LayeredModel], list[float]],
              rounds: int) -> tuple[LayeredModel, int]:
    """Measure ``partition(model, n_stages)``, refine the costs, split again; ``rounds`` times at most.

    ``measure(model)`` returns the compute ms per micro-batch of each stage of that model's split
    (the same numbers on every process, so that all reach the same split). Returns the model of
    the split that measured most even and the round it was measured in. Even, not fastest: every
    split does the same work, and the slowest stage over the mean does not drift with the
    machine's speed between runs (a CPU run's totals moved 10% from one round to the next).

    A new split is tried only when the refined costs predict its slowest stage at least
    ``MIN_GAIN`` (relative) below the current split's measured one, and only once. Below that
    gain timing noise decides; and a boundary layer can flip between two splits that each look
    better from the other. Keeping the most even split measured undoes a move predicted wrongly.
    """
    best_imbalance, best, best_round = float("inf"), model, 0
    tried: set[tuple[int, ...]] = set()
    for round_ in range(rounds + 1):
        specs = partition(model, n_stages)
        tried.add(tuple(len(spec.layers) for spec in specs))
        stage_ms = measure(model)
        if imbalance(stage_ms) < best_imbalance:
            best_imbalance, best, best_round = imbalance(stage_ms), model, round_
        if round_ == rounds:
            break
        refined = refine_costs(model, specs, stage_ms)
        proposed = partition(refined, n_stages)
        if (tuple(len(spec.layers) for spec in proposed) in tried
                or max(spec.cost for spec in proposed) > (1 - MIN_GAIN) * max(stage_ms)):
            break
        model = refined
    return best, best_round
