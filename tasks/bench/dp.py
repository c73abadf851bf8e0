"""Our data parallelism beside torch DDP and FSDP2, on 1 GPU and on every launched GPU, in one run.

    torchrun --nproc-per-node 2 -m tasks.bench.dp --model gpt2-large --batch 64 --seq 1024 --out runs/bench_dp.json

Weak scaling: ``--batch`` sequences per GPU per optimizer step, in micro-batches of ``--micro-batch``.
Each row runs first on rank 0 alone (the other ranks wait), then on all N ranks:
- ``ours DDP`` / ``ours ZeRO-2`` / ``ours ZeRO-3`` / ``ours ZeRO-3 held`` (its weights gathered once a step and
  held): ``nanotrain.data_parallel`` (bf16 compute, fp32 masters and moments on the GPU with ``--states gpu``,
  fp32 gradient sums), recompute ``--recompute``;
- ``torch DDP``: transformers' model of the same family, fp32 parameters, bf16 autocast, fused AdamW,
  ``no_sync`` on all micro-batches but the last;
- ``FSDP2``: the same model under ``fully_shard`` per block and at the root, bf16 parameters and
  fp32 reduction, fused AdamW, reducing once a step (its unsharded gradients kept over the micro-batches);
  ``FSDP2 sync`` reduces each micro-batch, ``FSDP2 held`` too, each block's weights kept gathered from its forward
  to its backward (``reshard_after_forward=False``).
With ``--gpu-mem-gib G`` each rank's allocator stops at G GiB (``set_per_process_memory_fraction``), so a
larger card runs as a smaller one (an 80 GB H100's 79 on an H200): a row that needs more fails out of memory.
With ``--compile`` each block of every row is ``torch.compile``d (the peers' before they are wrapped:
torchtitan's recipe). With ``--no-single`` the rows run on all N ranks only (a model one GPU cannot hold).
Reported per row: total seq/s, scaling efficiency (seq/s on N / (N x seq/s on 1)), and the
largest peak GPU memory of any rank. With ``--profile``, each row takes one more step under
torch.profiler and reports, from rank 0's trace, the step's communication time and its exposed
part: the time in which a collective runs and no other kernel (``monitor.trace.communication_ms``;
NCCL kernels on a GPU, gloo operators on a CPU), also as a share of that profiled step. On the
CPU (``--device cpu``: gloo, with ``--model tiny``) it only checks the harness: its times mean nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanotrain.core.machine import GIB
from nanotrain.core.models import init_params, model_spec, preset
from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.distributed import close_distributed, init_distributed
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.resident import TrainConfig
from nanotrain.monitor.profile import is_communication
from nanotrain.monitor.trace import communication_ms, load_events
from tasks.bench.common import Row, free_memory, need_cuda, peak_gib, print_table, reset_peak, time_steps, write_json
from tasks.bench.peers.hf import blocks, fsdp2, hf_model, hf_train_step


def batch(cfg: Any, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same random global batch on every rank."""
    tokens = torch.randint(0, model_spec(cfg).vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def ours(zero: int, cfg: Any, group, device: torch.device, args, hold: bool = False):
    world = dist.get_world_size(group)
    cuda = device.type == "cuda"
    ocfg = OffloadConfig(device=str(device), dtype=torch.bfloat16 if cuda else torch.float32,
                         offload=args.states == "cpu", keep_32bit=model_spec(cfg).fp32_moments)
    tcfg = TrainConfig(batch=args.batch * world, micro_batch=args.micro_batch,
                       recompute=args.recompute, compile=args.compile)
    trainer = data_parallel_trainer(cfg, init_params(cfg, seed=0), tcfg, AdamConfig(lr=1e-5), ocfg,
                                    DPConfig(zero=zero, bucket_mb=args.bucket_mb, hold=hold), group)
    x, y = batch(cfg, args.batch * world, args.seq)
    return lambda: trainer.step(x, y), trainer.close


def _hf_step(model, cfg: Any, group, device: torch.device, args, no_sync):
    """This rank's share of the global batch, stepped as torch's data parallelism steps it (AdamW, fused on a
    GPU); nothing to close."""
    rank = dist.get_rank(group)
    x, _ = batch(cfg, args.batch * dist.get_world_size(group), args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    return hf_train_step(model, opt, x[rank * args.batch:(rank + 1) * args.batch], args.micro_batch, device,
                         autocast=device.type == "cuda", no_sync=no_sync), lambda: None


def torch_ddp(cfg: Any, group, device: torch.device, args):
    from torch.nn.parallel import DistributedDataParallel

    model = hf_model(cfg, recompute=args.recompute != "none", device=str(device))
    if args.compile:
        for block in blocks(model):
            block.compile()
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=args.bucket_mb,
                                  device_ids=[device] if device.type == "cuda" else None)
    return _hf_step(ddp, cfg, group, device, args, lambda skip: ddp.no_sync() if skip else contextlib.nullcontext())


def torch_fsdp2(cfg: Any, group, device: torch.device, args, sync_each: bool = False, reshard: bool = True):
    """FSDP2 reducing once a step, or each micro-batch (``sync_each``); ``reshard`` False: each block's weights kept
    from its forward to its backward."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, device.type)
    model = fsdp2(hf_model(cfg, recompute=args.recompute != "none", device=str(device)), mesh, compile=args.compile,
                  reshard_after_forward=reshard)

    def no_sync(skip: bool):
        model.set_requires_gradient_sync(sync_each or not skip)
        return contextlib.nullcontext()
    return _hf_step(model, cfg, group, device, args, no_sync)


ROWS = {"ours-ddp": ("ours DDP", lambda *a: ours(0, *a)), "ours-zero2": ("ours ZeRO-2", lambda *a: ours(2, *a)),
        "ours-zero3": ("ours ZeRO-3", lambda *a: ours(3, *a)),
        "ours-zero3-held": ("ours ZeRO-3 held", lambda *a: ours(3, *a, hold=True)),
        "torch-ddp": ("torch DDP", torch_ddp), "fsdp2": ("FSDP2 (HF)", torch_fsdp2),
        "fsdp2-sync": ("FSDP2 (HF) sync", lambda *a: torch_fsdp2(*a, sync_each=True)),
        "fsdp2-held": ("FSDP2 (HF) held", lambda *a: torch_fsdp2(*a, sync_each=True, reshard=False))}
# --rows: (row name, its step's maker)


def profiled(step, trace: Path, device: torch.device) -> dict[str, float]:
    """One more step under torch.profiler, its trace written to ``trace``: the step's time, its
    communication and the exposed part of that (ms), and the exposed share of the step."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step_ms = time_steps(step, 0, 1) * 1e3
    prof.export_chrome_trace(str(trace))
    comm, exposed = communication_ms(load_events(trace), is_communication)
    return {"profiled_step_ms": step_ms, "comm_ms": comm, "exposed_ms": exposed, "exposed_share": exposed / step_ms}


def measure(key: str, cfg: Any, group, device: torch.device, args) -> Row | None:
    """Rank 0's row for ``key`` on ``group`` (every member returns it; a failure prints and gives None)."""
    world = dist.get_world_size(group)
    free_memory()  # the previous row's models and optimizers, in reference cycles too, and the cached blocks
    reset_peak()  # this row's peak only
    profile = {}
    try:
        step, close = ROWS[key][1](cfg, group, device, args)
        seconds = time_steps(step, args.warmup, args.steps)
        if args.profile:
            trace = Path(args.trace_dir) / f"{key}-x{world}-rank{dist.get_rank(group)}.json"
            profile = profiled(step, trace, device)
        close()
        failed = 0
    except Exception:  # one row failing (out of memory, say) must not stop the others
        traceback.print_exc()
        seconds, failed = float("nan"), 1
    stats = torch.tensor([peak_gib(), failed], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    if stats[1]:
        return None
    return Row.measured(f"{ROWS[key][0]} x{world}", cfg, args.batch * world, args.seq, seconds, float(stats[0]),
                        mfu_over=world, gpus=world, seconds=seconds, **profile)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-large")
    ap.add_argument("--batch", type=int, default=64, help="sequences per GPU per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--recompute", default="none", help="ours: none/every/...; HF peers: gradient checkpointing "
                                                        "unless none")
    ap.add_argument("--states", default="gpu", choices=["gpu", "cpu"], help="ours: where masters and moments live")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (ours: with --recompute none)")
    ap.add_argument("--no-single", dest="single", action="store_false",
                    help="no row on one GPU alone (no scaling column): for a model one GPU cannot hold")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="one more step per row under torch.profiler: "
                    "communication and its exposed part (traces beside --out, else discarded)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo, a smoke test only")
    ap.add_argument("--gpu-mem-gib", type=float, default=None,
                    help="each rank's allocator stops here: a larger card run as a smaller one (79: an H100's)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        need_cuda("tasks.bench.dp", "--device cpu --model tiny")
    keep = args.out is not None and args.profile
    if args.profile:  # traces beside --out, else in a folder removed at the end
        args.trace_dir = (str(Path(args.out).with_suffix("")) + "-traces" if keep
                          else tempfile.mkdtemp(prefix="bench_dp_"))
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    ctx = init_distributed(backend="nccl" if args.device == "cuda" else "gloo")
    if args.gpu_mem_gib and args.device == "cuda":
        total = torch.cuda.get_device_properties(ctx.device).total_memory
        if args.gpu_mem_gib * GIB > total:
            raise SystemExit(f"error: --gpu-mem-gib {args.gpu_mem_gib:g} is more than this GPU's "
                             f"{total / GIB:.1f} GiB; pass less, or leave it out")
        torch.cuda.set_per_process_memory_fraction(args.gpu_mem_gib * GIB / total, ctx.device)
    cfg = preset(args.model)
    # every rank creates every group, each waiting as long as the world's
    groups = {1: dist.new_group([0], timeout=ctx.grid.timeout), ctx.world_size: dist.group.WORLD}
    if not args.single:
        del groups[1]
    rows = []
    for key in args.rows.split(","):
        if key not in ROWS:
            raise SystemExit(f"error: unknown row {key!r} (known: {', '.join(ROWS)})")
        for world, group in groups.items():
            row = measure(key, cfg, group, ctx.device, args) if ctx.rank < world else None
            dist.barrier()
            rows.append(row)
        one, many = rows[-2:] if args.single else (None, rows[-1])
        if one is not None and many is not None:
            many.extra["scaling"] = many.seq_per_s / (ctx.world_size * one.seq_per_s)
    if ctx.rank == 0:
        done = [r for r in rows if r is not None]
        columns = {"scaling": lambda r: f"{100 * r.extra['scaling']:.1f}%" if "scaling" in r.extra else ""}
        if args.profile:  # the profiled step's time, its communication and the part no other kernel overlaps
            columns |= {h: lambda r, k=k: f"{r.extra[k]:.1f}" for h, k in
                        (("profiled ms", "profiled_step_ms"), ("comm ms", "comm_ms"), ("exposed ms", "exposed_ms"))}
            columns["exposed share"] = lambda r: f"{100 * r.extra['exposed_share']:.2f}%"
        print_table(done, columns=columns)
        write_json(args.out, done, model=args.model, batch_per_gpu=args.batch, seq=args.seq, gpus=ctx.world_size,
                   micro_batch=args.micro_batch, recompute=args.recompute, states=args.states,
                   gpu_mem_gib=args.gpu_mem_gib)
    if args.profile and not keep:
        shutil.rmtree(args.trace_dir, ignore_errors=True)
    close_distributed(ctx)


if __name__ == "__main__":
    main()
