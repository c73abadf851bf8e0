"""Loading a model into the streamed optimizer holds it once: a bf16 checkpoint read into an fp32 tree, then
taken leaf by leaf into the optimizer's arenas, peaks at the arenas (``StreamJob.load_peak``), not at the tree
plus the arenas; a data-parallel rank holds its share and the leaf in flight (``core.leaves.rank_load_bytes``), never
the fp32 tree. Measured in fresh processes (their peak RSS), on the CPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from nanotrain.core.models import model_spec
from nanotrain.core.models.llama.config import LlamaConfig
from nanotrain.distributed import free_port
from weights import random_checkpoint

CFG = LlamaConfig(n_layer=4, n_embd=512, n_head=8, n_kv_head=2, intermediate_size=1792, vocab_size=16000, n_ctx=256)

CHILD = """
import sys, torch
from nanotrain.core.machine import GIB, host_rss_gib, return_freed_memory_to_the_os
from nanotrain.stream.footprint import StreamJob
from nanotrain.core.models import model_spec
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.stream.optimizer import StreamedAdam
from tests.core.test_load_rss import CFG
from weights import load_hf
torch.set_num_threads(1)
return_freed_memory_to_the_os()
spec = model_spec(CFG)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak so far (imports) is not the load's
base = host_rss_gib()[0] * GIB
tree = load_hf(sys.argv[1], CFG, dtype=torch.float32)
loaded = host_rss_gib()[0] * GIB - base
opt = StreamedAdam(tree, spec.unit_dict(), AdamConfig(), OffloadConfig(device="cpu", state_bits=8,
                                                                       keep_32bit=spec.fp32_moments))
del tree
job = StreamJob(CFG, 1, 1, 8)
print(loaded, host_rss_gib()[1] * GIB - base, sum(job.arena(u) for u in spec.units))
"""


def test_the_loaded_model_is_held_once(tmp_path: Path):
    path = random_checkpoint(CFG, 0, torch.bfloat16, root=tmp_path)
    n = model_spec(CFG).costs.total_params
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    loaded, peak, arenas = (float(x) for x in out.stdout.split())
    # RSS also moves with the interpreter's own allocations and frees: a few MiB (16 of slack)
    assert abs(loaded - 4 * n) <= 16 * 2**20  # the fp32 tree
    assert peak <= arenas + 16 * 2**20, (peak / n, arenas / n)  # not the tree and the arenas together


RANK_CHILD = """
import sys, torch
import torch.distributed as dist
from nanotrain.core.footprint import leaf_moment_bytes
from nanotrain.core.machine import GIB, host_rss_gib, return_freed_memory_to_the_os
from nanotrain.core.leaves import rank_load_bytes
from nanotrain.core.models import model_spec
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.shard import moment_block
from nanotrain.data_parallel.buckets import plan_buckets
from nanotrain.data_parallel.shards import ShardedAdam
from tests.core.test_load_rss import CFG
from weights import open_weights
torch.set_num_threads(1)
dist.init_process_group("gloo")
return_freed_memory_to_the_os()
spec, world, units = model_spec(CFG), dist.get_world_size(), model_spec(CFG).unit_dict()
ocfg = OffloadConfig(device="cpu", dtype=torch.bfloat16, offload=False, state_bits=8, keep_32bit=spec.fp32_moments)
shapes = {leaf.path: torch.Size(leaf.shape) for leaf in spec.leaves}
buckets = plan_buckets(units, shapes, 0, world, moment_block(ocfg))  # ZeRO-3's (``data_parallel.zero3``)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = host_rss_gib()[0] * GIB
with open_weights(CFG, sys.argv[1]) as leaves:
    opt = ShardedAdam(leaves, units, buckets, AdamConfig(), ocfg, dist.group.WORLD, sharded=True)
kept = lambda p: (6 * shapes[p].numel() + leaf_moment_bytes(spec, p, 8)) / world  # fp32 masters, bf16 weights, moments
print(host_rss_gib()[1] * GIB - base, rank_load_bytes(spec, 2, kept), sum(map(kept, shapes)))
"""


def test_a_data_parallel_rank_holds_its_share_of_the_load_as_the_plan_says(tmp_path: Path):
    """What each of 3 ZeRO-3 ranks holds while loading (``data_parallel.shards.take``; ``core.leaves.rank_load_bytes``,
    the plan's host peak of a data-parallel rank): its share of what it keeps (here on the CPU, its "device": fp32
    masters, 8-bit moments, fp32 for the embeddings, and bf16 weights: 3.8 bytes a parameter of the model here) and the
    leaf in flight as read (bf16), never the fp32 tree beside it as the ranks built it before (4 bytes a parameter,
    more than the leaf in flight and the slack allowed here)."""
    path = random_checkpoint(CFG, 0, torch.bfloat16, root=tmp_path)
    n = model_spec(CFG).costs.total_params
    env = os.environ | {"WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_CHILD, str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
                              env=env | {"RANK": str(r)}) for r in range(3)]
    outs = [rank.communicate(timeout=600) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), [err for _, err in outs]
    largest = 16000 * 512  # the embedding (and the untied head)
    for out, _ in outs:
        peak, estimate, share = (float(x) for x in out.split())
        # the estimate: the share and the largest leaf counted twice as read (``in_flight``: a fused leaf's parts and
        # the joined leaf); read once here, and the moments and weights made once the last leaf is in, so the peak lies
        # between the share and the estimate (16 MiB of slack for the interpreter's own allocations, as above)
        assert 0 <= estimate - (share + 2 * 2 * largest) <= len(model_spec(CFG).units), (estimate, share)  # ceils
        assert share - 16 * 2**20 <= peak <= estimate + 16 * 2**20, (peak / n, estimate / n)
