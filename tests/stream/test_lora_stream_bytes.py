"""An adapted streamed step's GPU bytes (``core.lora_footprint.streamed_lora_bytes``) against what the streamed trainer
allocates on the CPU (fp32, the CPU as the device), tails of 0, 1 and 2 blocks in passes of one or two sequences, the
base in fp32 and in NF4, Llama and Qwen2 (q|k|v biases) shapes.

The step-long buffers (block slots, the tail's slot, weights and fp32 gradients, a block's gradients) are every tensor
Python reaches after the trainer is built, less the host arenas: equal to the count but for a scalar. A block's
backward (one micro-batch's block recomputed with autograd) is the profiler's allocated peak during ``_backward``: the
count bounds it (its activations the base block's eager table plus the pairs', an upper bound for a frozen base; its
temporaries ``BACKWARD_TEMPS``'). The head phase is not checked here: on the CPU the LM head's loss runs unfused (seven
fp32 copies of a chunk's logits where a GPU's compiled kernel keeps three) and its attention otherwise than a GPU's.
"""
from __future__ import annotations

import gc
import time

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from nanotrain.core.lora_footprint import stored, streamed_lora_bytes
from nanotrain.core.models import model_spec, preset, run
from nanotrain.core.models.lora import LoraConfig, with_lora
from nanotrain.core.optim import OffloadConfig
from nanotrain.core.optim.quant8 import dynamic_code
from nanotrain.core.tree import named_leaves
from nanotrain.stream.trainer import StreamConfig, StreamTrainer
from tests.core.test_lora_trainer import batches
from tests.core.test_trainer import ADAM
from tests.stream.test_stream_plan import _held

ALL = ("q", "k", "v", "o", "gate", "up", "down")
SPECS = {"llama": with_lora(model_spec(preset("tiny-llama", n_layer=4, vocab_size=512)), LoraConfig(4, 8.0, ALL)),
         "qwen2": with_lora(model_spec(preset("tiny-llama", n_layer=4, vocab_size=200, architecture="qwen2",
                                              tie_word_embeddings=True)), LoraConfig(4, 8.0, ("q", "v", "down")))}
BATCH, SEQ = 8, 16


def _allocated(prof) -> list[tuple[int, int]]:
    """(time, bytes allocated since the profile began) at each allocation and free the profiler saw."""
    events = []

    def walk(es):
        for e in es:
            if e.tag == _EventType.Allocation:
                events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated))
            walk(e.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    events.sort()
    start = events[0][2] - events[0][1]
    return [(t, total - start) for t, _, total in events]


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("bits", [16, 4])
@pytest.mark.parametrize("micro_batch,tail,tail_mb", [(2, 0, None), (2, 1, 1), (4, 2, 2), (4, 2, 1)])
def test_an_adapted_streamed_step_holds_what_is_counted(name, bits, micro_batch, tail, tail_mb):
    spec = SPECS[name]
    dynamic_code(True, torch.device("cpu")), dynamic_code(False, torch.device("cpu"))  # made once per process
    params = run.init_params(spec, seed=1)
    loaded = sum(t.untyped_storage().nbytes() for _, t in named_leaves(params))
    gc.collect()
    before = sum(_held().values()) - loaded
    trainer = StreamTrainer(spec, params, StreamConfig(BATCH, micro_batch, tail=tail, tail_micro_batch=tail_mb), ADAM,
                            OffloadConfig(device="cpu", dtype=torch.float32, base_bits=bits))
    del params
    gc.collect()
    arenas = sum(u.arena._raw.untyped_storage().nbytes() for u in trainer.opt.units.values())
    built = sum(_held().values()) - before - arenas
    count = streamed_lora_bytes(spec, stored(spec, 4, bits), BATCH, micro_batch, SEQ, 0, tail, tail_mb)
    assert 0 <= built - (count.slots + count.grads + count.tail) <= 8  # a scalar or two

    backward = trainer._backward
    began = []
    trainer._backward = lambda *a: (began.append(time.time_ns()), backward(*a))[1]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.step(*next(batches(spec, 1, BATCH, SEQ)))
    peak = max(b for t, b in _allocated(prof) if t >= began[0])
    assert peak <= count.boundaries + dict(count.phases)["blocks' backward"], (peak, count)
    trainer.close()
