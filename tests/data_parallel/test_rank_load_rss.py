"""Each ZeRO-3 rank of an untied-embedding model (Qwen2's shape: a 152,064-token vocabulary, embedding and head
separate) holds its share and a leaf in flight while its trainer is built from random weights, as the plan's
``core.leaves.rank_load_bytes`` says, and the first rank no more than the others: no rank holds a whole embedding or
head beside its share. The run's path (``data_parallel_trainer`` over seeded leaves, watched by ``Loading``) in 3
fresh gloo processes on the CPU, their peak RSS read."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from nanotrain.core.models import model_spec
from nanotrain.core.models.llama.config import LlamaConfig
from nanotrain.distributed import free_port

# 79M parameters, 78M of them the embedding and the head (39M each): the loads differ by what holds those
CFG = LlamaConfig(n_layer=2, n_embd=256, n_head=4, n_kv_head=2, intermediate_size=512, vocab_size=152064, n_ctx=256,
                  tie_word_embeddings=False, architecture="qwen2")
WORLD = 3

CHILD = """
import math, torch
import torch.distributed as dist
from nanotrain.core.footprint import leaf_moment_bytes
from nanotrain.core.leaves import Loading, rank_load_bytes, seeded
from nanotrain.core.machine import GIB, host_rss_gib, return_freed_memory_to_the_os
from nanotrain.core.models import model_spec
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.resident import TrainConfig
from nanotrain.data_parallel.config import DPConfig
from nanotrain.data_parallel.trainer import data_parallel_trainer
from tests.data_parallel.test_rank_load_rss import CFG
torch.set_num_threads(1)
dist.init_process_group("gloo")
return_freed_memory_to_the_os()
spec, world = model_spec(CFG), dist.get_world_size()
ocfg = OffloadConfig(device="cpu", dtype=torch.bfloat16, offload=False, keep_32bit=spec.fp32_moments)  # "on the GPU"
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = host_rss_gib()[0] * GIB
leaves = Loading(spec, "random").watch(seeded(spec, 0, "cpu", torch.bfloat16))  # the run's --weights random
data_parallel_trainer(CFG, leaves, TrainConfig(batch=2 * world, micro_batch=2, recompute="every"), AdamConfig(), ocfg,
                      DPConfig(zero=3), dist.group.WORLD)
# what a rank keeps of a leaf on its device (here the CPU): fp32 master and moments, the bf16 weights it gathers from,
# and its fp32 gradient sums (``GatheredWeights``, allocated once the leaves are in)
kept = lambda p: (4 + 2 + 4) * math.prod(spec.leaf(p).shape) / world + leaf_moment_bytes(spec, p, 32) / world
print(host_rss_gib()[1] * GIB - base, rank_load_bytes(spec, 4, kept), sum(map(kept, spec.shapes)))
"""


def test_every_zero3_rank_holds_its_share_and_a_leaf_in_flight(tmp_path: Path):
    env = os.environ | {"WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2], env=env | {"RANK": str(r)})
             for r in range(WORLD)]
    outs = [rank.communicate(timeout=300) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), [err for _, err in outs]
    peaks = []
    largest = 152064 * 256  # the embedding's and the head's elements
    for out, _ in outs:
        peak, estimate, share = (float(x) for x in out.split())
        # the estimate: the share and the largest leaf in flight, counted twice at 4 bytes (drawn in fp32 here, then
        # rounded to bf16: 6 bytes); 16 MiB of slack for the interpreter's own allocations (as tests/core's loads)
        assert share - 16 * 2**20 <= peak <= estimate + 16 * 2**20, (peak / 2**20, estimate / 2**20)
        peaks.append(peak)
    # no rank holds a whole embedding or head (148.5 MiB in fp32) beyond another: the broadcast's source keeps nothing
    assert max(peaks) - min(peaks) <= 16 * 2**20 < 4 * largest, [p / 2**20 for p in peaks]
    assert model_spec(CFG).costs.total_params > 2 * largest
