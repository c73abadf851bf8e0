"""Know before you launch: the plan ``tasks.finetune`` would run, its speed on a named GPU, its peaks, its disk.

    python -m tasks.plan --model llama-3.2-1b --gpu H100 --batch 32                      # one 80 GB card
    python -m tasks.plan --model llama-3.1-8b --gpu H100 --gpus 4 --batch 64             # a 4-GPU node
    python -m tasks.plan --model llama-3.1-8b --gpu 4090 --host-mem-gib 64 --adam-bits 8 --batch 32
    python -m tasks.plan --model gpt2-xl --gpu H200 --gpu-mem-gib 11 --host-mem-gib 16 --adam-bits 8 --batch 64
    python -m tasks.plan --model llama-3.1-8b --gpu-mem-gib 8 --lora-rank 16 --lora-targets q,k,v,o,gate,up,down

No GPU is needed. The model is a preset or a Hugging Face folder (only its config.json is read). The GPU cap
defaults to the named card's memory (less its CUDA context); the speeds are each engine's step-time model
(``nanotrain.plan.search``) with the card's datasheet peak, host link and peer link, stated in the output. The
search is ``tasks.finetune``'s: every engine (resident with masters and moments on the GPU or in host memory,
streamed, DDP and ZeRO-1/2/3 over ``--gpus``, tensor x pipeline layouts) under both caps, the fastest predicted
first; a flag given pins its setting, as it does for ``tasks.finetune``; a cap no plan meets is refused in one
line naming the smallest caps or GPU count that work. The host memory starts from an assumed 1 GiB for the
process before loading (Python, torch, the data; ``--process-gib``): ``tasks.finetune`` measures its own.
"""
from __future__ import annotations

import argparse

from nanotrain.core.footprint import GIB, allocator_setting
from nanotrain.plan.report import Machine, plan_table
from nanotrain.plan.candidates import Ask, Box, Pins
from nanotrain.plan.search import search
from nanotrain.run import lora
from nanotrain.run.cli import fail, model_config
from nanotrain.stream.search import GPUS
from nanotrain.core.recompute import RecomputePolicy


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", help="a preset or a Hugging Face model folder")
    ap.add_argument("--gpu", default="H100", choices=list(GPUS), help="the card the speed is predicted for")
    ap.add_argument("--gpus", type=int, default=1, help="how many of them, on one host")
    ap.add_argument("--gpu-mem-gib", type=float, default=None, help="cap on GPU memory (default: the card's)")
    ap.add_argument("--host-mem-gib", type=float, default=None,
                    help="cap on each process's host memory (default: none)")
    ap.add_argument("--batch", type=int, default=32, help="sequences per optimizer step")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--adam-bits", type=int, default=8, choices=[32, 8])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="compute dtype")
    ap.add_argument("--clip-norm", type=float, default=None, help="clipping (streamed: deferred updates)")
    ap.add_argument("--compile", action="store_true", help="compiled blocks (resident: without recompute only)")
    g = ap.add_argument_group("pins: each one given is kept; the rest is planned")
    g.add_argument("--stream", action="store_true", help="stream the weights")
    g.add_argument("--states", default=None, choices=["cpu", "gpu"], help="masters and moments")
    g.add_argument("--recompute", default=None, help="none, lean, selective, every, every-K")
    g.add_argument("--micro-batch", type=int, default=None)
    g.add_argument("--tail", type=int, default=None, help="streamed: the tail")
    g.add_argument("--tail-micro-batch", type=int, default=None)
    g.add_argument("--dp", type=int, default=None)
    g.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3])
    g.add_argument("--tp", type=int, default=None)
    g.add_argument("--pp", type=int, default=None)
    g.add_argument("--schedule", default=None, help="a pipeline schedule")
    ap.add_argument("--process-gib", type=float, default=1.0,
                    help="host memory of the process before loading: Python, torch, the data (assumed: 1 GiB)")
    ap.add_argument("--rows", type=int, default=0, help="also print the fastest N plans")
    lora.add_args(ap)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        cfg = lora.model(args, model_config(args.model))  # with --lora-rank the adapted spec: the adapters' plans
        if args.recompute is not None:
            RecomputePolicy.parse(args.recompute)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    gpu = GPUS[args.gpu]
    machine = Machine(gpu.name, gpu.costs(), gpu.peak_flops)
    expandable, allocator = allocator_setting()
    box = Box(args.gpus, int((args.gpu_mem_gib or gpu.memory_gib) * GIB),
              None if args.host_mem_gib is None else int(args.host_mem_gib * GIB), machine.costs, gpu.peer_bytes_s,
              int(args.process_gib * GIB), expandable)
    pins = Pins(args.stream, args.states, args.recompute, args.micro_batch, args.tail, args.tail_micro_batch,
                args.dp, args.zero, args.tp, args.pp, args.schedule)
    fp16, dtype_bytes = args.dtype == "fp16", 4 if args.dtype == "fp32" else 2
    ask = Ask(cfg, args.batch, args.seq, args.adam_bits, dtype_bytes, fp16, args.clip_norm is not None or fp16,
              compile=args.compile, pins=pins, base_bits=args.lora_base_bits)
    try:
        plans = search(ask, box)
    except MemoryError as e:
        fail(str(e))
    print(plan_table(plans[0], ask, box, machine, allocator, args.model))
    if args.rows:
        print("\n".join(f"  {q.describe()}" for q in plans[:args.rows]) + f"\n  ({len(plans)} plans fit)")


if __name__ == "__main__":
    main()
