"""The offloading peers of issue 30, around ``transformers``' model of a family with gradient checkpointing, under
the same GPU cap as our streamed row, one peer per process (a cap is per process, and a peer that runs out of
memory must not take the others with it):

    python -m tasks.bench.peers.offload --peer torchao --model llama-3.1-8b --gpu-mem-gib 24 --batch 32 --micro-batch 1
    python -m tasks.bench.peers.offload --peer deepspeed --model llama-3.2-3b --gpu-mem-gib 24 ...

- ``torchao``: ``torchao.optim.CPUOffloadOptimizer`` (its AdamW on the CPU, gradients offloaded as backward
  produces them; ``--adam-bits 8``: torchao's ``AdamW8bit`` inside it), bf16 weights on the GPU;
- ``deepspeed``: ZeRO-3 with parameters and optimizer state offloaded to the CPU (DeepSpeed's CPU Adam, built
  with nvcc on first use), bf16, one process (world size 1).
Prints one JSON line: seq/s, tokens/s, MFU, peak GPU GiB, peak RSS GiB, or the error that stopped it.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from typing import Callable

import torch

from nanotrain.core.machine import host_rss_gib, set_gpu_cap
from nanotrain.core.models import model_spec, preset
from tasks.bench.common import need_cuda, peak_gib, throughput
from tasks.bench.peers.hf import hf_model, hf_train_step


def torchao_step(cfg, args, tokens: torch.Tensor) -> Callable[[], None]:
    from torchao.optim import AdamW8bit, CPUOffloadOptimizer

    with torch.device("cuda"):  # random init on the GPU, in bf16: never a host copy of the whole model
        model = hf_model(cfg, recompute=True, torch_dtype=torch.bfloat16)
    inner = AdamW8bit if args.adam_bits == 8 else torch.optim.AdamW
    opt = CPUOffloadOptimizer(model.parameters(), inner, offload_gradients=True, lr=1e-4)
    return hf_train_step(model, opt, tokens, args.micro_batch, torch.device("cuda"))


def deepspeed_step(cfg, args, tokens: torch.Tensor) -> Callable[[], None]:
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    ds = {"train_micro_batch_size_per_gpu": args.micro_batch,
          "gradient_accumulation_steps": args.batch // args.micro_batch, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                "overlap_comm": True, "contiguous_gradients": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    keep = HfDeepSpeedConfig(ds)  # noqa: F841 (transformers builds the model under zero.Init while it lives)
    model = hf_model(cfg, recompute=True, torch_dtype=torch.bfloat16)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)

    def step() -> None:
        for chunk in tokens.split(args.micro_batch):
            chunk = chunk.cuda(non_blocking=True)
            engine.backward(engine(input_ids=chunk, labels=chunk).loss)  # the engine scales by the accumulation
            engine.step()  # the engine steps the optimizer at the accumulation boundary itself
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", choices=["torchao", "deepspeed"], required=True)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--gpu-mem-gib", type=float, default=24.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--adam-bits", type=int, default=8, choices=[8, 32])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    need_cuda("tasks.bench.peers.offload")
    cfg = preset(args.model)
    row = {"peer": args.peer, "model": args.model, "gpu_cap_gib": args.gpu_mem_gib, "batch": args.batch,
           "micro_batch": args.micro_batch, "seq": args.seq}
    try:
        set_gpu_cap(args.gpu_mem_gib, torch.device("cuda", torch.cuda.current_device()))
        tokens = torch.randint(0, model_spec(cfg).vocab_size, (args.batch, args.seq))
        step = (torchao_step if args.peer == "torchao" else deepspeed_step)(cfg, args, tokens)
        times = []
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            print(f"{args.peer} step {i + 1}: {times[-1]:.1f} s", flush=True)
        row |= throughput(cfg, args.batch, args.seq, sum(times[args.warmup:]) / args.steps)
        row |= {"peak_gib": peak_gib(), "step_s": times}
    except Exception as e:  # noqa: BLE001 (the row says what stopped the peer; the bench goes on)
        traceback.print_exc()
        row |= {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", "peak_gib": peak_gib()}
    row["peak_rss_gib"] = host_rss_gib()[1]
    print("ROW " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
