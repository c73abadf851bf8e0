"""The composed 3D trainer's plans for the one search (``candidates.py`` says how the engines offer theirs): tensor x
pipeline (x data) layouts of all the GPUs, predicted by ``compose.planner`` and stated at what such layouts measured
(``MEASURED_OVER_3D``), kept under the GPU cap with the one margin and under the host cap by ``_host_3d``."""
from __future__ import annotations

from typing import Iterator

from nanotrain.core.footprint import HOST_ADAM_PARAMS_S, HostPlan, fits, plan_resident_host
from nanotrain.core.models import model_spec
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.plan.candidates import Ask, Box, options, with_rank_load
from nanotrain.plan.plan import Plan

# The 3D engine's measured steps over ``compose.planner``'s predictions, the worst of each kind: issue 37's table
# (4 H100s, llama-3.2-1b at batch 128, states on the GPU, eager) against ``tasks.plan`` for the same layouts:
# tp 4 1.29x, tp 2 x dp 2 1.43x; pp 2 x dp 2 1.85x, pp 4 2.32x (data parallelism's own: 1.05-1.15x). An eager 3D
# plan states its step at that, so the search weighs it as it ran, not as the model of its collectives says.
# Compiled blocks ran as the model says (4 H200s, 2026-11-28, the same runs compiled, recompute none: tp 2 x dp 2
# 0.660 s against 0.745 predicted, pp 2 x dp 2 zb-h1 0.596 against 0.602), so a compiled plan's step is the model's.
MEASURED_OVER_3D = {"tp": 1.43, "pp": 2.32}



def composed(ask: Ask, box: Box) -> Iterator[Plan]:
    """Tensor x pipeline (x data) parallel layouts of all the GPUs (``compose.planner``'s predictions)."""
    p = ask.pins
    # adapters train on one or replicated GPUs; held weights are ZeRO-3's, which the 3D trainer does not build
    if box.gpus == 1 or p.stream or p.hold or (p.tp, p.pp) == (1, 1) or ask.lora:
        return
    # the 3D engine's planner, imported where a layout may use it: a one-GPU run loads no engine it does not run
    from nanotrain.compose.planner import Hardware, Training, plan as plan_3d
    spec = model_spec(ask.cfg)
    n = spec.costs.total_params
    hw = Hardware(box.gpus, box.gpu_cap, box.costs.flops, box.tp_bytes_s or box.peer_bytes_s, box.peer_bytes_s,
                  reserve_bytes=0,  # the allocated peak, kept under the cap by every engine's one ``margin`` below
                  layer_overhead_s=box.costs.pass_overhead_s)  # per layer and action: the streamed model's, measured
    for states in options(p.states, ("gpu", "cpu")):
        training = Training(ask.dtype_bytes, ask.adam_bits, offload=states == "cpu")
        try:
            preds = plan_3d(ask.cfg, ask.seq, hw, ask.batch, training)
        except ValueError:
            return
        for q in preds:
            lay = q.layout
            given = ((p.tp, lay.tp), (p.pp, lay.pp), (p.dp, lay.dp), (p.zero, lay.zero),
                     (p.micro_batch, lay.micro_batch), (p.schedule, lay.schedule))
            recompute = "every" if lay.recompute else "none"
            # what the 3D engine refuses (``run.compose.check_model``): a pipeline over dropout (not trained as one
            # process would), a sharded state's norm over key/value heads that several TP ranks share
            refused = lay.pp > 1 and spec.dropout.any or ask.deferred and lay.zero and lay.tp > spec.heads[1]
            fit = fits(int(q.mem_bytes), box.gpu_cap, box.expandable, lay.tp * lay.pp * lay.dp)
            if (not fit or lay.tp * lay.pp == 1 or refused or any(k is not None and k != v for k, v in given)
                    or p.recompute is not None and p.recompute != recompute):
                continue
            host = _host_3d(ask, box, lay.tp * lay.pp * (lay.dp if lay.zero else 1), states, recompute)
            if box.host_cap is not None and host.total > box.host_cap:
                continue
            adam = 0 if states == "gpu" else n * (1 if lay.zero else lay.dp)  # every rank's share, one host
            eager = not ask.compiled or lay.recompute  # the ranks compile no block a recompute is given for
            step = q.step_s * (MEASURED_OVER_3D["pp"] if lay.pp > 1 else MEASURED_OVER_3D["tp"]) if eager else q.step_s
            yield Plan("3d", lay.micro_batch, states, recompute, max(step, adam / HOST_ADAM_PARAMS_S),
                       int(q.mem_bytes), host.total, dp=lay.dp, zero=lay.zero, tp=lay.tp, pp=lay.pp,
                       schedule=lay.schedule, sp=lay.sequence_parallel, detail=q, host_detail=host.detail)


def _host_3d(ask: Ask, box: Box, shards: int, states: str, recompute: str) -> HostPlan:
    """A 3D rank's host bytes: the resident engine's (masters and moments there, 1/``shards`` each: the rank's TP
    shard of its stages, and its ZeRO share) and, while loading, its share of each leaf and one leaf in flight
    (``compose.layered``: each rank cuts its shard as it reads). The average rank's: a pipeline's first and last
    ranks hold the embedding and the head beside their blocks."""
    on_host = states == "cpu"
    host = plan_resident_host(ask.cfg, 1, ask.seq, RecomputePolicy.parse(recompute), ask.adam_bits, on_host, True,
                              box.base_rss, fp16=ask.fp16, shards=shards, exact_skip=ask.exact_skip,
                              compiled=ask.compiled)  # the 3D engine compiles any block
    return with_rank_load(host, ask, box, 1 / shards if on_host else 0)
