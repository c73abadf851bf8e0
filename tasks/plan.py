"""Know before you launch: the plan ``tasks.finetune`` would run, its speed on a named GPU, its peaks, its disk.

    python -m tasks.plan --model llama-3.1-8b --gpu 4090 --host-mem-gib 64 --adam-bits 8 --batch 32 --seq 1024
    python -m tasks.plan --model qwen2.5-7b --gpu H100 --gpu-mem-gib 24 --host-mem-gib 64 --adam-bits 8
    python -m tasks.plan --model gpt2-xl --gpu H200 --gpu-mem-gib 11 --host-mem-gib 16 --adam-bits 8 --batch 64
    python -m tasks.plan --model llama-3.1-8b --gpu-mem-gib 8 --lora-rank 16 --lora-targets q,k,v,o,gate,up,down

No GPU is needed. The model is a preset or a Hugging Face folder (only its config.json is read). The GPU cap
defaults to the named card's memory (less its CUDA context); the speed is the step-time model's
(``nanotrain.stream.search``) with the card's datasheet peak and host link, stated in the output. As
``tasks.finetune`` does, a model that fits the GPU cap resident is planned resident (``--stream`` plans
streaming anyway), else its weights are streamed; a cap that no plan meets is refused in one line naming
the smallest caps that work. The host memory starts from an assumed 1 GiB for the process before loading
(Python, torch, the data; ``--process-gib``): ``tasks.finetune`` measures its own instead.
"""
from __future__ import annotations

import argparse

from nanotrain.run.cli import fail, model_config
from nanotrain.core.footprint import (GIB, allocator_setting, choose_micro_batch, divisors, plan_resident_host,
                                     state_bytes)
from nanotrain.core.lora_footprint import (adapter_params, adapter_state_bytes, choose_lora_micro_batch, frozen_bytes,
                                           streamed_lora_bytes)
from nanotrain.run import lora
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.plan.report import Machine, resident_table, stream_table
from nanotrain.stream.search import GPUS, format_ranked, search_streaming
from nanotrain.plan.run import stream_job
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", help="a preset or a Hugging Face model folder")
    ap.add_argument("--gpu", default="H100", choices=list(GPUS), help="the card the speed is predicted for")
    ap.add_argument("--gpu-mem-gib", type=float, default=None, help="cap on GPU memory (default: the card's)")
    ap.add_argument("--host-mem-gib", type=float, default=None, help="cap on host memory (default: none)")
    ap.add_argument("--batch", type=int, default=32, help="sequences per optimizer step")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--adam-bits", type=int, default=8, choices=[32, 8])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="compute dtype")
    ap.add_argument("--stream", action="store_true", help="plan weight streaming even if the model fits resident")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--tail", type=int, default=None, help="streamed: keep this tail (default: planned)")
    ap.add_argument("--tail-micro-batch", type=int, default=None)
    ap.add_argument("--recompute", default="none", help="resident plans: none, lean, selective, every, every-K")
    ap.add_argument("--states", default="cpu", choices=["cpu", "gpu"], help="resident plans: masters and moments")
    ap.add_argument("--clip-norm", type=float, default=None, help="clipping (streamed: deferred updates)")
    ap.add_argument("--process-gib", type=float, default=1.0,
                    help="host memory of the process before loading: Python, torch, the data (assumed: 1 GiB)")
    ap.add_argument("--rows", type=int, default=0, help="also print the fastest N streamed plans")
    lora.add_args(ap)
    return ap


def lora_plan(args: argparse.Namespace, cfg, policy: RecomputePolicy, gpu_cap: int, host_cap: int | None) -> str:
    """The adapters' plan (``--lora-rank``): resident when it fits the GPU cap (and not ``--stream``), else streamed;
    what each holds, from ``core.lora_footprint``."""
    spec = lora.model(args, cfg)
    dtype_bytes = 4 if args.dtype == "fp32" else 2
    pairs = adapter_params(spec)
    base = frozen_bytes(spec, dtype_bytes, args.lora_base_bits)
    head = (f"{args.model} LoRA rank {args.lora_rank} on {','.join(a.target for a in spec.adapters)}: "
            f"{pairs / 1e6:.1f}M trained parameters of {spec.costs.total_params / 1e9:.2f}B, the base in "
            f"{'NF4' if args.lora_base_bits == 4 else args.dtype} ({base / GIB:.2f} GiB)")
    states = adapter_state_bytes(spec, args.adam_bits)
    if not args.stream:
        try:
            plan = choose_lora_micro_batch(spec, args.batch, args.seq, policy, gpu_cap, dtype_bytes,
                                           args.lora_base_bits, states if args.states == "gpu" else 0)
            return f"{head}\nresident, {plan.describe()}; masters and moments {states / GIB:.2f} GiB on {args.states}"
        except MemoryError as e:
            head += f"\nnot resident: {e}"
    for on_host in (False, True):
        for mb in reversed(divisors(args.batch)):
            streamed = streamed_lora_bytes(spec, args.batch, mb, args.seq, dtype_bytes, args.lora_base_bits,
                                           args.adam_bits, on_host)
            if streamed.gpu <= gpu_cap and (host_cap is None or streamed.host <= host_cap):
                where = "in host memory" if on_host else "on the GPU"
                return f"{head}\nstreamed, micro-batch {mb}, block inputs {where}: {streamed.describe()}"
    fail(f"{head}\nno streamed LoRA plan fits a GPU cap of {gpu_cap / GIB:.2f} GiB"
         f"{'' if host_cap is None else f' and a host cap of {host_cap / GIB:.2f} GiB'}: {streamed.describe()} at "
         f"micro-batch 1; raise the caps, shorten --seq or use --lora-base-bits 4")


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        cfg = model_config(args.model)
        policy = RecomputePolicy.parse(args.recompute)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    gpu = GPUS[args.gpu]
    machine = Machine(gpu.name, gpu.costs(), gpu.peak_flops)
    gpu_cap = int((args.gpu_mem_gib or gpu.memory_gib) * GIB)
    host_cap = None if args.host_mem_gib is None else int(args.host_mem_gib * GIB)
    base = int(args.process_gib * GIB)
    if args.lora_rank is not None:
        print(lora_plan(args, cfg, policy, gpu_cap, host_cap))
        return
    expandable, allocator = allocator_setting()
    job = stream_job(cfg, args, base, expandable)
    if not args.stream:
        try:
            states = state_bytes(cfg, args.adam_bits) if args.states == "gpu" else 0
            resident = choose_micro_batch(cfg, args.batch, args.seq, policy, gpu_cap, job.dtype_bytes, states)
        except MemoryError:
            resident = None
        if resident is not None:
            host = plan_resident_host(cfg, resident.micro_batch, args.seq, policy, args.adam_bits,
                                      args.states == "cpu", True, base)
            if host_cap is None or host.total <= host_cap:
                print(resident_table(job, resident, host, args.recompute, args.states, machine, gpu_cap, host_cap,
                                     allocator, args.model))
                return
    try:
        ranked = search_streaming(job, gpu_cap, host_cap, machine.costs, args.micro_batch, args.tail,
                                  args.tail_micro_batch)
    except MemoryError as e:
        fail(str(e))
    print(stream_table(ranked[0], machine, gpu_cap, host_cap, allocator, args.model))
    if args.rows:
        print(format_ranked(ranked, args.batch, args.rows))


if __name__ == "__main__":
    main()
