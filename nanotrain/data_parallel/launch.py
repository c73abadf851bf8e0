"""The task side of data parallelism: its command-line options, and joining (or starting) the ranks of any grid.

    torchrun --nproc-per-node 4 -m tasks.finetune --dp 4 --zero 1 ...   # one process per GPU
    python -m tasks.finetune --dp 2 ...                                  # the same, started here
    torchrun --nproc-per-node 2 -m tasks.finetune --dp 2 --stream ...    # ZeRO-Offload: weights streamed, each
                                                                         # rank's host holds 1/N of the state
    torchrun --nnodes 2 --node-rank K --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        --rdzv-id JOB -m tasks.finetune --dp 8 ...                       # on each of two nodes
    torchrun --max-restarts 3 ... --save-every 50                        # a failed worker restarts the group,
                                                                         # which resumes from OUT/latest

Without torchrun, ``--dp N`` starts N local processes with ``nanotrain.distributed.spawn`` that run
the same command. Every rank runs the whole task on the same global batches; only the first rank
prints, writes metrics and plots, and saves (the others take part in gathering the state). The
launcher passes SIGINT and SIGTERM on to the ranks, waits for their save, and ends as they do (by
that signal when they stopped early: ``train.preempt``); a rank outlives no launcher.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable

import torch

from nanotrain.data_parallel.config import DPConfig, check_split, stage_name
from nanotrain.distributed import GridConfig, SpawnError, spawn
from nanotrain.distributed.spawn import Stopped
__all__ = ["add_dp_args", "check_dp_args", "check_resumed_split", "check_split", "describe", "dp_config",
           "mute_other_ranks", "resume_after_restart", "started_here", "state_shards"]

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_dp_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("data parallelism (nanotrain.data_parallel)")
    g.add_argument("--dp", type=int, default=1,
                   help="data-parallel ranks: each takes 1/N of every batch (under torchrun: its process count; "
                        "without it, N local processes are started)")
    g.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                   help="0: DDP; 1: optimizer state sharded; 2: gradients reduce-scattered as well; 3: weights "
                        "sharded too, gathered unit by unit (without a GPU --recompute every is its default)")
    g.add_argument("--hold-weights", action="store_true",
                   help="ZeRO-3: gather each unit once a step and hold it to the step's end (the whole model's weights "
                        "on each GPU, as ZeRO-1/2 hold them; gradients and state still sharded): one all-gather a "
                        "step instead of two each micro-batch")
    g.add_argument("--bucket-mb", type=float, default=25.0, help="fp32 gradient megabytes per reduction")
    g.add_argument("--dp-reduce-dtype", default="fp32", choices=list(REDUCE_DTYPES),
                   help="what gradients travel and are summed in")
    g.add_argument("--dp-check", action="store_true", help="after every step, check every rank holds equal weights")
    g.add_argument("--sharded-save", action="store_true",
                   help="kept for old command lines; has no effect: every run saves each rank's own shard (no rank "
                        "gathers the whole state), and any layout resumes it (docs/CHECKPOINTS.md)")


def check_dp_args(args: argparse.Namespace, resumed: bool = False) -> None:
    """Refuse what the data-parallel engine cannot do, before anything is loaded or any process starts.
    ``resumed``: the settings are a checkpoint's, so a fix keeps its --batch (the run stays exact)."""
    if args.dp < 1:
        raise ValueError(f"--dp {args.dp} must be at least 1")
    if resumed and args.batch % (args.dp * (args.micro_batch or 1)):
        check_resumed_split(args)
    if args.batch % args.dp:
        raise ValueError(f"--batch {args.batch} does not split over --dp {args.dp} ranks; use a batch that is a "
                         f"multiple of {args.dp} (e.g. {-(-args.batch // args.dp) * args.dp})")
    launched = int(os.environ.get("WORLD_SIZE", 1))
    if launched > 1 and launched != args.dp:
        raise ValueError(f"{launched} processes were launched but --dp is {args.dp}; pass --dp {launched}")
    if args.dp > 1 and args.micro_batch:
        check_split(args.batch, args.micro_batch, args.dp)
    streamed = args.stream and args.dp > 1  # ZeRO-Offload (stream.zero_offload): ZeRO-2, the state in host memory
    if streamed and args.zero not in (0, 2):
        raise ValueError(f"--stream with --dp shards the masters and moments and reduce-scatters the gradients by "
                         f"itself (ZeRO-2, the state in host memory); leave out --zero {args.zero}")
    if streamed and args.dp_reduce_dtype != "fp32":
        raise ValueError(f"--stream with --dp reduces gradients in fp32; leave out --dp-reduce-dtype "
                         f"{args.dp_reduce_dtype}")
    if args.zero and args.dp == 1:
        raise ValueError(f"--zero {args.zero} shards over data-parallel ranks; pass --dp N with N > 1")


def check_resumed_split(args: argparse.Namespace) -> None:
    """The run's batch does not split over ``args.dp`` ranks (in its micro-batches): name the world sizes that
    split it, the run's --batch kept, so the resumed run continues the saved one exactly."""
    micro = args.micro_batch or 1
    fits = [d for d in range(1, args.batch + 1) if args.batch % (d * micro) == 0]
    micro_fits = [m for m in range(1, args.batch // args.dp + 1) if args.batch % (args.dp * m) == 0]
    split = f" in micro-batches of {micro}" if args.micro_batch else ""
    other = f", or --micro-batch {_one_of(micro_fits)} at --dp {args.dp}" if args.micro_batch and micro_fits else ""
    raise ValueError(f"the run's --batch {args.batch} does not split over --dp {args.dp} ranks{split}; resume with "
                     f"--dp {_one_of(fits)}{other} (a --batch of its own would make the run differ from the saved "
                     f"one: --allow-changes)")


def _one_of(values: list[int]) -> str:
    return ", ".join(map(str, values[:-1])) + f" or {values[-1]}" if len(values) > 1 else str(values[0])


def state_shards(args: argparse.Namespace) -> int:
    """Among how many ranks the masters and moments are shared (what each rank's host memory holds 1/N of)."""
    return args.dp if args.zero or args.stream else 1


def dp_config(args: argparse.Namespace) -> DPConfig:
    return DPConfig(zero=args.zero, bucket_mb=args.bucket_mb, reduce_dtype=REDUCE_DTYPES[args.dp_reduce_dtype],
                    check_replicas=args.dp_check, hold=args.hold_weights)


STARTED_HERE = "NANOTRAIN_STARTED_HERE"  # set for the processes ``started_here`` starts


def started_here(grid: GridConfig, main: Callable[[list[str]], None], argv: list[str] | None) -> bool:
    """Outside torchrun with a grid of N > 1 ranks (``--dp``, or ``--tp x --pp x --dp``): run ``main(argv)`` on N
    local processes, and say so. Raises ``Stopped`` when a signal stopped them (the caller ends by it, as they did:
    ``core.train.preempt.exit_by``)."""
    if grid.size == 1 or "RANK" in os.environ:
        return False
    os.environ[STARTED_HERE] = "1"  # for the processes only: the launcher runs on (a task may start more runs)
    try:
        # Forking spares each process importing torch again, but is unsafe once CUDA may be initialised.
        spawn(main, grid.size, (sys.argv[1:] if argv is None else argv,), timeout_s=math.inf, capture=False,
              start_method="spawn" if torch.cuda.is_available() else "fork")
    except Stopped:  # stopped early by a signal and saved (or stopped before training): the caller ends as they did
        raise
    except SpawnError as e:
        sys.exit(f"error: the {grid.size} processes stopped with exit codes {e.exit_codes}; their messages are above")
    finally:
        os.environ.pop(STARTED_HERE, None)
    return True


def resume_after_restart(args: argparse.Namespace) -> None:
    """Under ``torchrun --max-restarts K``, a restarted group resumes from the run's last complete
    checkpoint by itself (from the start if none was saved yet)."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0 and (args.out / "latest").is_file():
        args.resume = True


def mute_other_ranks() -> Callable[[], None]:
    """Ranks after the first print nothing (their errors still reach stderr). Processes ``started_here`` check
    what their launcher checked and printed already: their first rank is quiet too, until the returned
    function gives it its voice back (once they have joined)."""
    first, shown = int(os.environ.get("RANK", 0)) == 0, sys.stdout
    if not first or os.environ.get(STARTED_HERE):
        sys.stdout = open(os.devnull, "w")

    def speak() -> None:
        if first:
            sys.stdout = shown
    return speak


def describe(args: argparse.Namespace) -> str:
    if args.dp == 1:
        return ""
    stage = stage_name(args.zero, args.hold_weights)
    if args.stream:
        stage = f"ZeRO-2, 1/{args.dp} of the state in each rank's host memory"
    return f" over {args.dp} data-parallel ranks ({args.batch // args.dp} sequences each, {stage})"
