"""Each engine's footprint against the bytes that engine holds on a CPU run: the resident trainer's weights, gradient
buffers, masters and moments (32- and 8-bit), counted from the tensors its weight source and optimizer keep (the
streamed and 3D engines' are ``tests/stream/test_stream_plan.py``'s and
``tests/compose/test_parallel3d_planner.py``'s)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from nanotrain.core.footprint import estimate, state_bytes
from nanotrain.core.models import init_params, model_spec, preset
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig


def held_bytes(*roots: object) -> int:
    """The bytes of every distinct tensor storage reachable from ``roots`` through nanotrain's objects, dicts,
    lists and dataclasses."""
    seen: set[int] = set()

    def walk(o: object, depth: int) -> int:
        if isinstance(o, torch.Tensor):
            key = o.untyped_storage().data_ptr()
            if key in seen:
                return 0
            seen.add(key)
            return o.untyped_storage().nbytes()
        if depth > 6:
            return 0
        if isinstance(o, dict):
            return sum(walk(v, depth + 1) for v in o.values())
        if isinstance(o, (list, tuple)):
            return sum(walk(v, depth + 1) for v in o)
        if dataclasses.is_dataclass(o) or type(o).__module__.startswith("nanotrain"):
            return sum(walk(v, depth + 1) for v in vars(o).values()) if hasattr(o, "__dict__") else 0
        return 0
    return sum(walk(r, 0) for r in roots)


@pytest.mark.parametrize("model", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("bits", [32, 8])
def test_the_resident_trainer_holds_what_its_estimate_counts(model, bits):
    """Masters and moments on the device (``--states gpu``), bf16 weights: the estimate's weights, gradient
    accumulation and states, byte for byte (the 8-bit moments leaf by leaf: codes, a scale per block, small leaves
    and the embeddings at 32 bits)."""
    cfg = preset(model, n_layer=2)
    spec = model_spec(cfg)
    ocfg = OffloadConfig(device="cpu", dtype=torch.bfloat16, offload=False, state_bits=bits,
                         keep_32bit=spec.fp32_moments)
    trainer = ResidentTrainer(cfg, init_params(cfg, 0), TrainConfig(batch=4, micro_batch=2), AdamConfig(), ocfg)
    plan = estimate(cfg, 2, 16, RecomputePolicy.parse("none"), 2, states=state_bytes(cfg, bits))
    assert held_bytes(vars(trainer.weights), vars(trainer.opt)) == plan.weights + plan.grad_accum + plan.states
    trainer.close()


@pytest.mark.parametrize("model", ["llama-3.2-1b", "gpt2-large"])
def test_compiled_blocks_keep_what_inductor_saves_where_nothing_is_recomputed(model):
    """Blocks compiled keep the family's ``compiled`` count (``tests/core/test_activation_bytes.py`` grounds it) in
    place of ``none``'s, every block and nothing else; a policy that recomputes runs its blocks eagerly (the trainers
    compile only blocks they do not recompute), so its estimate is the eager one."""
    cfg = preset(model)
    costs = model_spec(cfg).costs
    none = RecomputePolicy.parse("none")
    eager, compiled = (estimate(cfg, 4, 1024, none, compiled=c) for c in (False, True))
    fewer = 4 * 1024 * costs.n_layer * (costs.activation_bytes("none") - costs.activation_bytes("compiled"))
    assert eager.total - compiled.total == eager.activations - compiled.activations == fewer > 0
    for policy in ("lean", "selective", "every", "every-2"):
        p = RecomputePolicy.parse(policy)
        assert estimate(cfg, 4, 1024, p, compiled=True) == estimate(cfg, 4, 1024, p)
