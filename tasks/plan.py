"""Know before you launch: the plan ``tasks.finetune`` would run, its speed on a named GPU, its peaks, its disk.

    python -m tasks.plan --model llama-3.2-1b --gpu H100 --batch 32                      # one 80 GB card
    python -m tasks.plan --model llama-3.1-8b --gpu H100 --gpus-found 4 --batch 64       # a 4-GPU node
    python -m tasks.plan --model llama-3.1-8b --gpu H100 --gpus 2 --batch 64             # 2 of its GPUs
    python -m tasks.plan --model llama-3.1-8b --gpu 4090 --host-mem-gib 64 --adam-bits 8 --batch 32
    python -m tasks.plan --model gpt2-xl --gpu H200 --gpu-mem-gib 11 --host-mem-gib 16 --adam-bits 8 --batch 64
    python -m tasks.plan --model llama-3.1-8b --gpu-mem-gib 8 --lora-rank 16 --lora-targets q,k,v,o,gate,up,down

No GPU is needed. The flags and their defaults are ``tasks.finetune``'s (its parser: the same flags print the
same plan), with the machine's own: the card (``--gpu``) and how many (``--gpus-found N``: as ``tasks.finetune``
finds them, the plan taking 1 to N; ``--gpus N`` takes N). The model is a preset or a Hugging Face folder (only
its config.json is read). The GPU cap defaults to the named card's memory (less its CUDA context); the speeds are
each engine's step-time model (``nanotrain.plan.search``) with the card's datasheet peak, host link and peer link,
stated in the output. The search is ``tasks.finetune``'s: every engine (resident with masters and moments on the
GPU or in host memory, streamed, DDP and ZeRO-1/2/3, tensor x pipeline layouts, on each GPU count the run may take)
under both caps, the fastest predicted first; a flag given pins its setting, as it does for ``tasks.finetune``; a
cap no plan meets is refused in one line naming the smallest caps or GPU count that work. The host memory starts
from an assumed 1 GiB for the process before loading (Python, torch, the data; ``--process-gib``):
``tasks.finetune`` measures its own.
"""
from __future__ import annotations

import argparse

from nanotrain.core.machine import GIB, allocator_setting
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.plan.report import Machine, plan_table
from nanotrain.plan.candidates import Ask, Box
from nanotrain.plan.run import ask, by_gpu_count
from nanotrain.plan.search import search, worlds
from nanotrain.run import compose, flags, lora
from nanotrain.run.cli import fail, given_dests
from nanotrain.run.inputs import resolve_model
from nanotrain.stream.search import GPUS


def parser() -> argparse.ArgumentParser:
    """``tasks.finetune``'s parser (its flags and their defaults: one source), and the machine planned for."""
    ap = flags.parser()
    ap.description = __doc__
    g = ap.add_argument_group("the machine planned for (tasks.plan's own)")
    g.add_argument("--gpu", default="H100", choices=list(GPUS), help="the card the speed is predicted for")
    g.add_argument("--gpus-found", type=int, default=1,
                   help="GPUs of the machine, as tasks.finetune finds them without --gpus or a layout flag: the plan "
                        "takes 1 to N of them, as many as its fastest does (--gpus N takes N)")
    g.add_argument("--process-gib", type=float, default=1.0,
                   help="host memory of the process before loading: Python, torch, the data (assumed: 1 GiB)")
    g.add_argument("--host-gib", type=float, default=None,
                   help="host memory available to the run, shared by its processes (tasks.finetune reads the host's "
                        "MemAvailable where --host-mem-gib is not given); default: not checked")
    g.add_argument("--rows", type=int, default=0, help="also print the fastest N plans")
    return ap


def planned(argv: list[str] | None) -> tuple[argparse.Namespace, Ask, Box, Machine]:
    """The settings of ``argv``, what they ask of a plan (``plan.run.ask``, as ``tasks.finetune`` asks it) and the
    machine: the named card, as many as ``--gpus`` or ``--gpus-found`` say, or the layout given."""
    ap = parser()
    args = flags.parse_args(argv, ap, on_gpu=True)  # the run's defaults, as on the GPU it plans for
    pins = flags.pinned(args, given_dests(ap, argv), {})
    try:
        cfg = lora.model(args, resolve_model(args).cfg)  # with --lora-rank the adapted spec: the adapters' plans
        RecomputePolicy.parse(args.recompute)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    if args.plan == "auto":  # the layout planned on the GPUs given, or the layout flags' count
        gpus, given = args.gpus or compose.grid(args).size, True
    else:
        gpus, given = compose.gpus_to_plan(args, pins, max(args.gpus_found, args.gpus))
    free = args.plan == "auto" or gpus > 1  # as tasks.finetune: a layout given is the run's world
    gpu = GPUS[args.gpu]
    machine = Machine(gpu.name, gpu.costs(), gpu.peak_flops)
    box = Box(gpus if free else compose.grid(args).size, int((args.gpu_mem_gib or gpu.memory_gib) * GIB),
              None if args.host_mem_gib is None else int(args.host_mem_gib * GIB), machine.costs, gpu.peer_bytes_s,
              int(args.process_gib * GIB), allocator_setting()[0],
              node_host=None if args.host_gib is None or args.host_mem_gib is not None else int(args.host_gib * GIB),
              card_bytes=int(gpu.memory_gib * GIB))
    return args, ask(args, cfg, pins, free_layout=free, gpus=gpus if given else None), box, machine


def main(argv: list[str] | None = None) -> None:
    args, asked, box, machine = planned(argv)
    try:
        plans = search(asked, box)
    except MemoryError as e:
        fail(str(e))
    print(plan_table(plans[0], asked, box, machine, allocator_setting()[1], args.model))
    if args.rows:
        print("\n".join(f"  {q.describe()}" for q in plans[:args.rows]) + f"\n  ({len(plans)} plans fit)")
    if box.gpus > 1:
        print(by_gpu_count(plans, worlds(asked, box)))
    print(f"plan: {plans[0].describe()}")


if __name__ == "__main__":
    main()
