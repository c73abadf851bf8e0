"""A data-parallel rank built from the model's leaves (``core.leaves``: each read once, in the model's order, and cut at
once to what the rank keeps) starts from exactly the state the whole fp32 tree gave it (``core.leaves.tree_of``, the
run's start path before): its pieces of masters and moments, and the compute-dtype weights it holds (DDP and ZeRO-1
the whole model's, ZeRO-3 its shard), bit for bit, on each of 3 ranks, from fp32 leaves and from bf16 ones (a
checkpoint's dtype: each becomes fp32 as it is cut). One spawned world runs every check."""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanotrain.core.leaves import seeded, tree_of
from nanotrain.core.models import model_spec
from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from tests.data_parallel.dp_cases import ADAM, CFG, CPU32, TCFG

SPEC = model_spec(CFG)
ZEROS = (0, 1, 3)
SOURCES = (torch.float32, torch.bfloat16)


def rank_start(zero: int, leaves_or_tree) -> dict[str, torch.Tensor]:
    """What this rank holds once built: its pieces' masters and moments, and the compute-dtype weights it keeps."""
    trainer = data_parallel_trainer(CFG, leaves_or_tree, TCFG, ADAM, CPU32, DPConfig(zero=zero, bucket_mb=0.3),
                                    dist.group.WORLD)
    out = {f"state.{k}": v.clone() for k, v in trainer.shard_state().entries.items()}
    if zero == 3:
        gathered = trainer.inner.weights
        out |= {f"shard.{b.name}": gathered.opt.new_shard(b).clone() for b in gathered.buckets}
    else:
        out |= {f"weights.{p}": w.clone() for unit, paths in SPEC.trainable_units().items()
                for p, w in zip(paths, trainer.opt.weights(unit))}
    trainer.close()
    return out


def worker() -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "gloo", timeout_s=60)
    out = {}
    with ctx.guard():
        for dtype in SOURCES:
            for zero in ZEROS:
                ctx.where = f"zero {zero}, {dtype}"
                from_leaves = rank_start(zero, seeded(SPEC, 7, dtype=dtype))  # refuses a leaf read twice or late
                from_tree = rank_start(zero, tree_of(SPEC, seeded(SPEC, 7, dtype=dtype)))
                masters = sum(v.numel() for k, v in from_leaves.items() if k.startswith("state.master"))
                out[(zero, str(dtype))] = (sorted(from_leaves) == sorted(from_tree),
                                           [k for k in from_tree if not torch.equal(from_leaves[k], from_tree[k])],
                                           masters)
    close_distributed(ctx)
    return out


def test_a_rank_from_leaves_starts_as_from_the_whole_tree():
    per_rank = spawn(worker, 3, start_method="fork", timeout_s=120)
    for rank, out in enumerate(per_rank):
        for (zero, dtype), (same_keys, differ, masters) in out.items():
            assert same_keys and differ == [], (rank, zero, dtype, differ)
            # DDP: every rank the whole model's masters; ZeRO: a third of them (the buckets' padding aside)
            n = SPEC.costs.total_params
            assert masters == n if zero == 0 else masters <= n // 3 + 64 * 3, (rank, zero, masters)
