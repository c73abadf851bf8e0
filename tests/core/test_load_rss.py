"""Loading a model into the streamed optimizer holds it once: a bf16 checkpoint read into an fp32 tree, then
taken leaf by leaf into the optimizer's arenas, peaks at the arenas (``StreamJob.load_peak``), not at the tree
plus the arenas. Measured in a fresh process (its peak RSS), on the CPU."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from nanotrain.core.models import model_spec
from nanotrain.core.models.llama.config import LlamaConfig
from weights import random_checkpoint

CFG = LlamaConfig(n_layer=4, n_embd=512, n_head=8, n_kv_head=2, intermediate_size=1792, vocab_size=16000, n_ctx=256)

CHILD = """
import sys, torch
from nanotrain.core.footprint import GIB, host_rss_gib, return_freed_memory_to_the_os
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


TREE_CHILD = """
import sys, torch
from nanotrain.core.footprint import GIB, host_rss_gib, return_freed_memory_to_the_os
from nanotrain.core.leaves import tree_load_bytes, tree_of
from nanotrain.core.models import model_spec
from tests.core.test_load_rss import CFG
from weights import open_weights
torch.set_num_threads(1)
return_freed_memory_to_the_os()
spec = model_spec(CFG)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = host_rss_gib()[0] * GIB
with open_weights(CFG, sys.argv[1]) as leaves:
    tree = tree_of(spec, leaves)
print(host_rss_gib()[1] * GIB - base, tree_load_bytes(spec, 2))
"""


def test_a_data_parallel_rank_s_whole_tree_peaks_as_the_plan_says(tmp_path: Path):
    """What each data-parallel rank holds while loading (``core.leaves.tree_of``, ``tree_load_bytes``; the plan's host
    peak of those ranks): the fp32 tree, and its largest leaf in flight as read (bf16 here) beside it."""
    path = random_checkpoint(CFG, 0, torch.bfloat16, root=tmp_path)
    n = model_spec(CFG).costs.total_params
    out = subprocess.run([sys.executable, "-c", TREE_CHILD, str(path)], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    peak, estimate = (float(x) for x in out.stdout.split())
    largest = 16000 * 512  # the embedding (and the untied head)
    # the estimate: the tree and the largest leaf counted twice as read (``in_flight``: a fused leaf's parts and the
    # joined leaf); read once here, so the peak lies between the tree plus one read and the estimate (16 MiB of slack
    # for the interpreter's own allocations, as above)
    assert estimate == 4 * n + 2 * 2 * largest
    assert 4 * n + 2 * largest - 16 * 2**20 <= peak <= estimate + 16 * 2**20, (peak / n, estimate / n)
