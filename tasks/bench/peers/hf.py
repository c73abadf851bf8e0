"""The peer most benchmarks race: transformers' model of the same family and shapes, and its training steps."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from nanotrain.core.models import model_spec
from weights import hf_config


def hf_model(cfg: Any, recompute: bool = False, device: str = "cpu", **kw):
    """transformers' model of ``cfg``'s family and shapes (random weights, initialised on ``device``; fp32 unless
    ``kw`` says otherwise, e.g. ``torch_dtype``), SDPA attention, gradient checkpointing with ``recompute``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config(cfg)), attn_implementation="sdpa",
                                                 **kw)
    assert model.config._attn_implementation == "sdpa"
    if recompute:
        model.gradient_checkpointing_enable()
    return model


def blocks(model) -> list:
    """``model``'s transformer blocks: the modules transformers never splits across devices."""
    return [m for m in model.modules() if type(m).__name__ in model._no_split_modules]


def fsdp2(model, mesh=None, offload: bool = False, compile: bool = False, reshard_after_forward: bool = True):
    """``model`` under FSDP2: ``fully_shard`` on each block, then at the root, bf16 parameters and fp32 gradient
    reduction, over ``mesh`` (default: every rank); parameters, gradients and AdamW on the CPU with ``offload``;
    each block ``torch.compile``d first with ``compile`` (torchtitan's recipe); ``reshard_after_forward`` False:
    each block's weights kept gathered from its forward to its backward (FSDP's ZeRO-2-like mode)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    policy = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                  reshard_after_forward=reshard_after_forward)
    if offload:
        policy["offload_policy"] = CPUOffloadPolicy()
    for block in blocks(model):
        if compile:
            block.compile()
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    return model


def hf_step(cfg: Any, mb: int, seq: int) -> Callable[[], None]:
    """One forward+backward of the bf16 model on the GPU, no optimizer."""
    model = hf_model(cfg).to(device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(0, model_spec(cfg).vocab_size, (mb, seq), device="cuda")

    def step() -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def hf_train_step(model, opt, tokens: torch.Tensor, micro_batch: int, device: torch.device, autocast: bool = False,
                  no_sync: Callable[[bool], Any] = lambda skip: contextlib.nullcontext()) -> Callable[[], None]:
    """One optimizer step of ``model`` on ``tokens`` (host memory), accumulated over micro-batches copied to
    ``device`` one by one; bf16 ``autocast``; ``no_sync(True)`` around every micro-batch but the last."""
    chunks = tokens.split(micro_batch)

    def step() -> None:
        for i, chunk in enumerate(chunks):
            chunk = chunk.to(device, non_blocking=True)
            with no_sync(i < len(chunks) - 1), torch.autocast(device.type, torch.bfloat16, enabled=autocast):
                loss = model(input_ids=chunk, labels=chunk, use_cache=False).loss / len(chunks)  # no KV cache
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step
