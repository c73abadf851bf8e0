"""The streaming memory model (``nanotrain.stream.footprint``): its arithmetic for the 8B shapes against
closed forms, its refusal line, and every byte class against what the trainer allocates (counted on the CPU).
No GPU."""
from __future__ import annotations

import dataclasses
import gc
import math
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from nanotrain.core import models
from nanotrain.core.footprint import cap_for, margin
from nanotrain.core.machine import CUDA_RUNTIME_BYTES, GIB, allocator_setting, use_expandable_segments
from nanotrain.stream.footprint import StreamChoice, StreamJob, estimate
from nanotrain.stream.search import GPUS, refusal, search_streaming, smallest_caps
from nanotrain.core.models import model_spec, preset
from nanotrain.core.optim import OffloadConfig
from nanotrain.core.optim.quant8 import dynamic_code
from nanotrain.stream.trainer import StreamConfig, StreamTrainer
from nanotrain.core.tree import named_leaves
from tests.core.test_trainer import ADAM, _batches

LLAMA8B, QWEN7B = preset("llama-3.1-8b"), preset("qwen2.5-7b")
H100 = GPUS["H100"].costs()


def job(cfg, bits: int = 8, **kw) -> StreamJob:
    return StreamJob(cfg, 32, 1024, bits, base_rss=GIB, **kw)


def closed_form_state(c: int, i: int, heads: int, kv: int, d: int, vocab: int, layers: int, bias: bool) -> int:
    """Masters and 8-bit moments of a Llama-class model, counted from its shapes: fp32 masters; tensors of 4096
    elements or more in 8 bits with an fp32 scale per 2048, smaller ones and the embedding and head 32-bit."""
    state = lambda n: 4 * n + (2 * n + 8 * math.ceil(n / 2048) if n >= 4096 else 8 * n)  # noqa: E731
    tensors = [(heads + 2 * kv) * d * c, heads * d * c, 2 * i * c, c * i, c, c] + [(heads + 2 * kv) * d] * bias
    return layers * sum(state(n) for n in tensors) + 2 * 12 * vocab * c + state(c)


@pytest.mark.parametrize("cfg,shape", [(LLAMA8B, (4096, 14336, 32, 8, 128, 128256, 32, False)),
                                       (QWEN7B, (3584, 18944, 28, 4, 128, 152064, 28, True))],
                         ids=["llama-3.1-8b", "qwen2.5-7b"])
def test_host_state_of_the_8b_shapes_is_the_closed_form(cfg, shape):
    j = job(cfg)
    state = sum(j.state(u) for u in j.spec.units)
    assert state == closed_form_state(*shape)
    arenas = dict(estimate(j, StreamChoice(8)).host)["masters and moments"]
    assert 0 <= arenas - state <= len(j.spec.units) * (4096 + 64 * 12)  # a page and the alignment per unit


def test_llama_8b_fits_24_gib_and_64_gib_with_8bit_moments_and_names_what_32bit_needs():
    ranked = search_streaming(job(LLAMA8B), 24 * GIB, 64 * GIB, H100)
    pick = ranked[0].plan
    assert pick.device_bytes + margin(24 * GIB, True) <= 24 * GIB and pick.host_bytes <= 64 * GIB
    # the embedding and head (2 x 525M parameters, 32-bit moments) cannot live in their slots under 24 GiB
    assert all(r.plan.choice.staged_ends for r in ranked)
    host = dict(pick.host)
    assert host["masters and moments"] > 50 * GIB and host["CUDA libraries"] == CUDA_RUNTIME_BYTES
    with pytest.raises(MemoryError) as e:
        search_streaming(job(LLAMA8B, 32), 24 * GIB, 64 * GIB, H100)
    need = float(str(e.value).split("--host-mem-gib ")[1].split()[0])
    assert 12 * 8.03e9 / GIB < need < 100  # fp32 masters and two fp32 moments, and the rest
    search_streaming(job(LLAMA8B, 32), 24 * GIB, int(need * GIB) + GIB // 10, H100)  # the named cap works


@pytest.mark.parametrize("cfg", [LLAMA8B, QWEN7B], ids=["llama-3.1-8b", "qwen2.5-7b"])
def test_the_smallest_gpu_cap_named_is_the_smallest_that_works(cfg):
    """At 12 GiB no plan fits: the refusal names the cap that does (above 12 GiB, under 18: llama-3.1-8b's plan at
    micro-batch 16 peaked at 13.89 GiB), and a tenth of a GiB less does not."""
    j = job(cfg)
    least, _ = smallest_caps(j, 12 * GIB, 64 * GIB)
    assert 12 * GIB < least < 18 * GIB
    search_streaming(j, least + 1, 64 * GIB, H100)
    with pytest.raises(MemoryError):
        search_streaming(j, least - GIB // 10, 64 * GIB, H100)
    line = refusal(j, 12 * GIB, 64 * GIB)
    assert "\n" not in line and f"--gpu-mem-gib {least / GIB:.1f}" in line


def test_the_refusal_names_each_cap_that_would_do_or_both():
    j = job(LLAMA8B)
    least_gpu, least_host = smallest_caps(j, 24 * GIB, 40 * GIB)
    assert least_gpu is None and least_host > 50 * GIB  # no GPU, however large, saves 50 GiB of state
    line = refusal(j, 24 * GIB, 40 * GIB)
    assert line.endswith(f"the smallest caps that work are --host-mem-gib {least_host / GIB:.1f} with this GPU cap")
    line = refusal(j, 12 * GIB, 40 * GIB)  # neither alone: the smallest GPU cap, with the host it needs there
    assert line.startswith("no streaming plan fits a 12.0 GiB GPU cap and a 40.0 GiB host cap at batch 32 x 1024")
    gpu, host = (float(line.split(flag)[1].split()[0]) for flag in ("--gpu-mem-gib ", "--host-mem-gib "))
    assert "\n" not in line and 12 < gpu < 18 and host > 50
    search_streaming(j, int(gpu * GIB) + GIB // 10, int(host * GIB) + GIB // 10, H100)


def test_the_gpt2_shaped_6_6b_measurement_is_what_the_model_predicts():
    """The one large measurement the model was fitted to (``stream_plan.UNACCOUNTED``): 22.68 GiB at the pick
    under 24 GiB, and out of memory for the 34 GiB pick with a 12-block tail, which it now refuses."""
    big = dataclasses.replace(preset("gpt2-xl"), n_layer=32, n_embd=4096, n_head=32)
    ran = estimate(job(big), StreamChoice(16, 26, 6, 2))
    assert abs(ran.device_bytes / GIB - 22.68) <= 0.01 * 22.68
    assert ran.fits(24 * GIB, None)
    assert not estimate(job(big), StreamChoice(16, 17, 12, 2)).fits(34 * GIB, None)


def test_the_margin_is_stated_and_wider_without_expandable_segments(monkeypatch):
    assert margin(24 * GIB, True) == GIB // 2 + int(0.03 * 24 * GIB)
    assert margin(24 * GIB, False) > 2.2 * GIB  # the fragmentation measured without them
    assert margin(cap_for(20 * GIB, True), True) + 20 * GIB <= cap_for(20 * GIB, True)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "NANOTRAIN_SET_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert allocator_setting() == (True, "allocator: expandable segments, set by nanotrain (PYTORCH_CUDA_ALLOC_CONF "
                                         "was unset)")
    assert use_expandable_segments()[0] and allocator_setting()[1].endswith("was unset)")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    on, line = use_expandable_segments()
    assert not on and "max_split_size_mb:512 as given (expandable segments off)" in line


def _held() -> dict[int, int]:
    """Every CPU tensor storage Python can reach, by address (as ``test_parallel3d_planner`` counts)."""
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated objects warns
        warnings.simplefilter("ignore", FutureWarning)
        return {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for o in gc.get_objects()
                if isinstance(o, torch.Tensor) and o.device.type == "cpu" and not isinstance(o, FakeTensor)}


STEP_LONG = ("block slots", "embedding and head slots", "staging", "block gradient", "tail weights and gradients",
             "host inputs' staging")


LLAMA = preset("tiny-llama", n_layer=3, vocab_size=512)  # three blocks: a tail and host inputs both fit
TIED = preset("tiny-llama", n_layer=3, vocab_size=512, tie_word_embeddings=True)


GPT2 = preset("tiny", n_layer=3, vocab_size=512)


@pytest.mark.parametrize("model", [LLAMA, TIED, GPT2], ids=["llama", "tied", "gpt2"])
@pytest.mark.parametrize("bits,choice", [(32, StreamChoice(2, 1, 1, 1)), (8, StreamChoice(2, 2, 0, None, True)),
                                         (32, StreamChoice(4, 1, 2, 2, True))], ids=["tail", "staged", "both"])
def test_every_byte_class_is_what_the_trainer_allocates(model, bits, choice):
    """On the CPU the device is host memory and every byte a tensor Python reaches: what building the trainer
    and one step leave is the optimizer's arenas (exactly the host classes), the boundary store's arena, and
    the step-long device classes, within 0.5% (a few scalars; the CPU's update scratch is left out: the GPU's
    8-bit update has none). The loaded tree is consumed, so it leaves the count."""
    spec = model_spec(model)
    dynamic_code(True, torch.device("cpu")), dynamic_code(False, torch.device("cpu"))  # made once per process
    params = models.init_params(model, seed=1)
    loaded = sum(t.untyped_storage().nbytes() for _, t in named_leaves(params))
    ocfg = OffloadConfig(device="cpu", dtype=torch.float32, state_bits=bits, keep_32bit=spec.fp32_moments,
                         staged_units=(spec.embed_unit.name, spec.head_unit.name) if choice.staged_ends else (),
                         stage_numel=4096)
    gc.collect()
    before = sum(_held().values()) - loaded
    trainer = StreamTrainer(model, params, StreamConfig(8, choice.micro_batch, choice.on_host, tail=choice.tail,
                                                        tail_micro_batch=choice.tail_micro_batch), ADAM, ocfg)
    trainer.step(*next(_batches(1)))
    del params
    gc.collect()
    held = _held()
    arenas = sum(held.pop(u.arena._raw.untyped_storage().data_ptr()) for u in trainer.opt.units.values())
    store = held.pop(trainer._store.arena._raw.untyped_storage().data_ptr(), 0)
    stager = trainer.opt._stager
    scratch = sum(held.pop(b.untyped_storage().data_ptr()) for s in (trainer.opt._scratch, stager and stager._scratch)
                  if s is not None for b in s._buffers.values())
    device = sum(held.values()) + arenas + store + scratch - before - arenas - store - scratch
    plan = estimate(StreamJob(model, 8, 16, bits, dtype_bytes=4, stage_numel=4096), choice)
    host, dev = dict(plan.host), dict(plan.device)
    assert arenas == host["masters and moments"]
    assert store == host["host block inputs"]
    counted = sum(dev[k] for k in STEP_LONG)
    assert abs(device - counted) <= 0.005 * counted, (device, {k: dev[k] for k in STEP_LONG})
    trainer.close()
