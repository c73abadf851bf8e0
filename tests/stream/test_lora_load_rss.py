"""A QLoRA model loaded into the streamed optimizer holds what it keeps and one leaf in flight, as the plan says
(``core.lora_footprint.lora_load_bytes``): its leaves read from a bf16 checkpoint as the streamed trainer's carrier
takes them (the base quantised to NF4 a matrix at a time, the pairs fresh), never the fp32 model. Measured in a fresh
process (its peak RSS, VmHWM), on the CPU."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from nanotrain.core.models import model_spec
from nanotrain.core.models.llama.config import LlamaConfig
from weights import random_checkpoint

# 93M parameters: a 32.8M-element embedding and head (the largest leaves, kept in bf16) and two blocks in NF4
CFG = LlamaConfig(n_layer=2, n_embd=1024, n_head=16, n_kv_head=4, intermediate_size=3584, vocab_size=32000, n_ctx=256,
                  tie_word_embeddings=False)

CHILD = """
import sys, torch
from nanotrain.core.machine import GIB, host_rss_gib, return_freed_memory_to_the_os
from nanotrain.core.frozen import frozen_paths
from nanotrain.core.lora_footprint import lora_load_bytes
from nanotrain.core.models import model_spec
from nanotrain.core.models.lora import LoraConfig, with_lora
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.run.lora import with_pairs
from nanotrain.stream.optimizer import StreamedAdam
from tests.stream.test_lora_load_rss import CFG
from weights import open_weights
torch.set_num_threads(1)
return_freed_memory_to_the_os()
spec = with_lora(model_spec(CFG), LoraConfig(8, 16.0, ("q", "k", "v", "o", "gate", "up", "down")))
frozen, nf4 = frozen_paths(spec, 4)
ocfg = OffloadConfig(device="cpu", dtype=torch.bfloat16, keep_32bit=spec.fp32_moments)  # the base kept in bf16
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak so far (imports) is not the load's
base = host_rss_gib()[0] * GIB
with open_weights(CFG, sys.argv[1]) as leaves:
    opt = StreamedAdam(with_pairs(spec, leaves, 0), spec.unit_dict(), AdamConfig(), ocfg, frozen, nf4)
kept = sum(u.arena.buffer.numel() for u in opt.units.values())
print(host_rss_gib()[1] * GIB - base, kept, lora_load_bytes(spec, 2, 4, 32))
"""


def test_a_qlora_load_holds_what_it_keeps_and_a_leaf_in_flight(tmp_path: Path):
    path = random_checkpoint(CFG, 0, torch.bfloat16, root=tmp_path)
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    peak, kept, estimate = (float(x) for x in out.stdout.split())
    n = model_spec(CFG).costs.total_params
    head = 2 * 32000 * 1024  # the last unit's leaf, in bf16 as read
    # the estimate's own terms: every arena (their pages as carved, within a page each of what it counts) ...
    assert abs(kept - (estimate - 2 * head)) <= 4 * 2**20
    # ... and the head's leaf in flight: counted twice as read (a fused leaf's parts and the joined leaf), read once
    # here, so the peak lies between the arenas plus one read and the estimate; a quantised chunk's temporaries
    # (core.nf4: 4M values, ~70 MiB on the CPU) come and go before the head's unit. RSS also moves with the
    # interpreter's own allocations and frees: a few MiB (16 of slack).
    assert kept + head - 16 * 2**20 <= peak <= estimate + 16 * 2**20, (peak / n, kept / n, estimate / n)
    assert peak < 4 * n  # far from the fp32 model the load once built (4 bytes a parameter, before any arena)
