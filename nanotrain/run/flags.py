"""The fine-tuning run's flags: the parser, and the checks every setting gets on its own before anything loads
(one ``error:`` line each); how a resume treats each saved setting is ``run.folder``'s."""
from __future__ import annotations

import argparse
from dataclasses import make_dataclass, replace
from pathlib import Path
from typing import Any

import torch

from nanotrain.run import toml_config
from nanotrain.run.cli import add_model_args, fail, own_weights, pick_device
from nanotrain.data import BIN_DTYPES
from nanotrain.data.text import STDLIB, source_file
from nanotrain.data_parallel import launch as dp
from nanotrain.core.machine import GIB
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.core.models import model_spec
from nanotrain.run import compose, lora
from nanotrain.plan.run import ask, check_resident_host, cpu_stream_micro_batch
from nanotrain.plan.candidates import Box
from nanotrain.plan.search import search
from nanotrain.stream.search import StreamCosts
from nanotrain.core.train.evaluate import add_eval_args
from nanotrain.core.train.schedule import add_schedule_args
DESCRIPTION = """Fine-tune any model (GPT-2, Llama 3.x, Qwen 2.5/3, Mistral) with AdamW under a GPU memory cap.

    python -m tasks.finetune --model gpt2-large --gpu-mem-gib 11 --batch 64 --seq 1024 --steps 30 --data stdlib
    python -m tasks.finetune --model tiny --batch 8 --seq 128 --steps 30 --data ../shared/data/tinyshakespeare.txt

A Hugging Face folder or hub id as ``--model`` trains its own weights (``--weights random``: from scratch), a
preset random ones (``--weights hub``: its pretrained ones). Every parameter is updated every step from fp32
master weights. Every flag left out is planned (``nanotrain.plan``: the fastest plan predicted to fit, printed
before anything loads): where the optimizer state lives (``--states gpu`` wherever it fits beside the rest, else
CPU memory), the recompute policy, the micro-batch, streaming, the ZeRO stage, and without a layout flag on a
machine of several GPUs how many of them run, in which layout (``--gpus N`` takes N); a flag given pins its setting.
One line per step, metrics in ``OUT/metrics.jsonl``, the loss curve in ``OUT/loss.png``,
checkpoints in ``OUT/step-N`` (``--save-every``, the ``--keep-last`` newest kept) that ``--resume``
continues exactly: with the saved run's settings for those not given again (a change that breaks
exactness needs ``--allow-changes``), up to ``--steps``, the run's total. A run whose steps keep
being skipped for a non-finite loss stops (``--max-skipped-steps``) without saving.

Weight streaming (``--stream``, or on its own when the model cannot fit the GPU cap otherwise):
weights, masters and moments stay in host memory and visit the GPU block by block
(``nanotrain.stream.trainer``). ``--host-mem-gib`` checks the plan against a host budget before
anything is allocated, and the measured peak RSS after every step:

    python -m tasks.finetune --model gpt2-xl --gpu-mem-gib 11 --host-mem-gib 16 --adam-bits 8 --steps 30

With ``--dp N`` each rank streams its rows of the batch and keeps 1/N of the masters and moments in
its host memory (ZeRO-Offload: ``nanotrain.stream.sharded``).

Tensor x pipeline x data parallelism (``nanotrain.run.compose``: ``--tp``, ``--pp``, ``--schedule``, ``--sp``,
``--plan auto``, ...) runs the 3D trainer through the same run, on T x P x D processes:

    python -m tasks.finetune --model tiny --n-layer 4 --tp 2 --pp 2 --dp 2 --schedule interleaved-1f1b --sp ...

What a run gives besides: a learning-rate schedule (``--lr-schedule cosine --warmup-steps 100``,
kept in the checkpoints), validation on held-out data (``--val-fraction 0.05 --eval-every 50``),
gradient clipping (``--clip-norm 1.0``, every trainer and ``--dp``), fp16 with loss scaling (``--dtype fp16``), a live
dashboard (TensorBoard event files in ``OUT``: ``just dashboard OUT``), a profile of chosen steps
(``--profile-steps 10:12``), run configs (``--config run.toml``; the resolved flags are saved as
``OUT/config.toml``), and clean pre-emption: SIGTERM or Ctrl-C saves at the next step boundary,
prints the command that resumes, and ends the process by that signal (exit status 143 or 130, not 0:
the run is not done). Every checkpoint holds its files' SHA-256 (``SHA256SUMS``); a resume takes the
newest checkpoint whose files match, and says so when it is not the latest (docs/CHECKPOINTS.md).
"""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, default_model="gpt2-large", default_weights=None)
    ap.add_argument("--n-layer", type=int, default=None, help="a preset with this many blocks (--weights random)")
    ap.add_argument("--data", default="stdlib",
                    help="a text file; a .jsonl of documents ({\"text\": ...}) or of instruction data ({\"prompt\": "
                         "..., \"response\": ...} or {\"messages\": [...]}: trained on the answers only, rendered "
                         "with the tokenizer folder's chat template if it has one); a .bin or .npy token file; or "
                         "'stdlib' (Python's own sources)")
    ap.add_argument("--data-dtype", choices=BIN_DTYPES, default=None,
                    help="the ids' dtype in a .bin token file (default uint16, as nanoGPT writes them; uint32 for "
                         "vocabularies over 65536 ids)")
    add_eval_args(ap)
    ap.add_argument("--batch", type=int, default=64, help="sequences per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per forward pass (default: from the cap)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--gpu-mem-gib", type=float, default=None, help="cap on GPU memory, enforced")
    ap.add_argument("--host-mem-gib", type=float, default=None,
                    help="cap on this process's host memory (peak RSS, locked buffers included): plans that "
                         "cannot fit are refused, and a step that overshoots stops the run")
    ap.add_argument("--stream", action="store_true",
                    help="stream weights block by block (default: only when the GPU cap needs it)")
    ap.add_argument("--tail", type=int, default=None,
                    help="with --stream: the top N blocks run with the head, micro-batch by micro-batch, "
                         "without recompute (default on a GPU: the plan predicted fastest within the caps; 0: none)")
    ap.add_argument("--tail-micro-batch", type=int, default=None,
                    help="sequences per pass through the tail (default: planned with --tail)")
    ap.add_argument("--recompute", "--checkpoint", dest="recompute", default=None,
                    help="activation recompute policy (--checkpoint is its old name): none, lean, selective, every, "
                         "every-K (default on a GPU: planned, the fastest that fits; without a GPU none, every under "
                         "--zero 3)")
    ap.add_argument("--adam-bits", type=int, default=32, choices=[32, 8])
    ap.add_argument("--states", default=None, choices=["cpu", "gpu"],
                    help="where masters and moments live (default: planned; gpu wherever they fit beside the rest; "
                         "cpu on a machine without a GPU)")
    ap.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    add_schedule_args(ap)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip-norm", type=float, default=None,
                    help="clip gradients to this global norm (exact; the update then waits for the whole backward, "
                         "but with --clip-overlap it updates speculatively and redoes a clipped step: "
                         "nanotrain/core/optim/clip_redo.py; with --stream the blocks' gradients wait in host memory, with "
                         "--dp each rank's shards of the reduced gradients: nanotrain/stream/deferred.py)")
    ap.add_argument("--clip-overlap", action="store_true",
                    help="with --clip-norm (resident trainer): keep the update overlapped with backward by updating "
                         "speculatively, at the cost of a second copy of masters and moments in host memory "
                         "(always so with --dtype fp16 --dp N)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                    help="compute dtype (auto: bf16 on a GPU, fp32 on the CPU); fp16, for GPUs without bf16, scales "
                         "the loss dynamically (nanotrain/core/train/scaler.py)")
    ap.add_argument("--compile", action="store_true", default=None,
                    help="torch.compile each block (--recompute none, --stream, or --tp/--pp: between the collectives; "
                         "default: on for a run on a GPU without dropout or a --recompute given, 1.4x for "
                         "llama-3.2-1b)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="run the blocks eagerly")
    ap.add_argument("--fixed-batch", action="store_true", help="train on the first batch every step")
    ap.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                    help="several examples per row, each attending only to itself (the default for instruction data; "
                         "--pack packs a text corpus's documents too, --no-pack pads one example per row: "
                         "nanotrain/core/models/documents.py)")
    ap.add_argument("--out", type=Path, default=Path("runs/finetune"))
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    ap.add_argument("--no-save", action="store_true",
                    help="save no checkpoint, not even at the end (benchmarks; a pre-empted run then stops unsaved)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from OUT/latest (or, if its files do not match their SHA256SUMS or are missing, the "
                         "newest intact checkpoint), with the saved run's settings for those not given again; --steps "
                         "is the run's total")
    ap.add_argument("--allow-changes", action="store_true",
                    help="with --resume: accept a --batch, --seq, --lr, ... other than the saved run's")
    ap.add_argument("--keep-last", type=int, default=3, help="checkpoints kept (the newest ones; 0: all)")
    ap.add_argument("--export", action="store_true",
                    help="at the end, export the last checkpoint as a folder that serves (OUT/export: bf16 "
                         "safetensors, config, generation config, tokenizer; any checkpoint: python -m tasks.export)")
    ap.add_argument("--export-every", type=int, default=0,
                    help="export the checkpoint of every N-th step to OUT/export (a multiple of --save-every)")
    ap.add_argument("--max-skipped-steps", type=int, default=10,
                    help="stop the run after this many steps in a row with a non-finite loss (0: never)")
    ap.add_argument("--profile-steps", default=None, metavar="A:B",
                    help="torch.profiler over steps A to B: OUT/profile/trace-rank0.json (Perfetto) and a summary")
    ap.add_argument("--no-tensorboard", dest="tensorboard", action="store_false",
                    help="no TensorBoard event files in OUT (written by default when tensorboard is installed; "
                         "view them with: just dashboard OUT)")
    lora.add_args(ap)
    dp.add_dp_args(ap)
    compose.add_args(ap)
    return ap


def parse_args(argv: list[str] | None, ap: argparse.ArgumentParser | None = None,
               on_gpu: bool | None = None) -> argparse.Namespace:
    """The settings of ``argv`` (with ``ap``: this parser's flags and more, ``tasks.plan``'s), each left out at the
    run's default; those decided by the device as on a GPU where ``on_gpu`` (default: as ``--device`` picks)."""
    args = toml_config.parse_args(ap or parser(), argv)  # --config run.toml under the command line
    if args.weights is None:  # decided here, from --model alone, so config.toml and every rank read the same value
        args.weights = own_weights(args.model)
    recompute_given = args.recompute not in (None, "none")
    if args.recompute is None:  # likewise from --zero: ZeRO-3 keeps the least memory
        args.recompute = "every" if args.zero == 3 else "none"
    if args.compile is None:  # compiled blocks are what a GPU run wants (docs/BENCHMARKS.md, 2026-11-27: 50% MFU)
        # where they are built and tested: not with a recompute given; with adapters too (llama-3.2-1b LoRA on an
        # H100, 2026-11-28: 80.6 seq/s compiled, 52.3 eager) and under --tp/--pp (llama-3.2-1b on 4 H200s,
        # 2026-11-28: tp 2 x dp 2 194 seq/s, pp 2 x dp 2 215, where eager ran ~120 and ~115)
        gpu = pick_device(args.device).type == "cuda" if on_gpu is None else on_gpu
        args.compile = gpu and not recompute_given
    return args


def eager_under_dropout(args: Any, pins: frozenset[str], cfg: Any) -> Any:
    """``args`` with the blocks eager where the model ``cfg`` or its adapters (``--lora-dropout``) drop out: dropout
    draws each block's masks from a generator seeded per block and step, and a compiled block is compiled again for
    each seed until torch's limit, then runs eagerly anyway. Not given, compiling is turned off, said in one line;
    given, it is refused."""
    rates = replace(model_spec(cfg).dropout, lora=args.lora_dropout if args.lora_rank else 0.0)
    if not args.compile or not rates.any:
        return args
    if "compile" in pins:
        fail(f"--compile with dropout ({rates}): each block's masks come from a generator seeded per block and "
             f"step, which a compiled block is compiled again for; drop --compile, or the dropout (--lora-dropout 0; "
             f"a model folder's own rates are in its config.json)")
    print(f"blocks run eagerly: dropout ({rates}) seeds each block's masks, which compiled blocks recompile for",
          flush=True)
    return replace(args, compile=False)


# The run's settings as one frozen value, a field per flag: built once the command line, --config and a resumed
# checkpoint's settings are read (``freeze``); the plan's choices replace the planned fields once, nothing writes it.
RunConfig = make_dataclass("RunConfig", [(dest, Any) for dest in dict.fromkeys(a.dest for a in parser()._actions)
                                         if dest != "help"]
                           + [("config", Any)], frozen=True)


def freeze(args: argparse.Namespace) -> Any:
    """The parsed (and resumed) settings as a ``RunConfig``."""
    return RunConfig(**vars(args))


def pinned(args: argparse.Namespace, given: set[str], saved: dict) -> frozenset[str]:
    """The settings a plan must keep: given on the command line, in ``--config``, or by the checkpoint resumed
    (``saved``: its run's settings, which a resume takes back)."""
    config = toml_config.config_defaults(parser(), Path(args.config)) if args.config else {}
    return frozenset(given | set(config) | set(saved))


def check_args(args: Any, pins: frozenset[str], cfg: Any, device: torch.device) -> None:
    """Every setting that can be wrong on its own, before anything is loaded or built: one error line."""
    positive = {"--steps": args.steps, "--batch": args.batch, "--seq": args.seq}
    for flag, value in positive.items():
        if value < 1:
            fail(f"{flag} {value} must be at least 1")
    spec = model_spec(cfg)
    if args.seq > spec.n_ctx:
        fail(f"--seq {args.seq} exceeds {args.model}'s {spec.longest}; use --seq {spec.n_ctx} or less")
    if args.micro_batch is not None and (args.micro_batch < 1 or args.batch % args.micro_batch):
        fail(f"--micro-batch {args.micro_batch} does not divide --batch {args.batch}; pick one of "
             f"{', '.join(str(d) for d in range(1, args.batch + 1) if args.batch % d == 0)}")
    for flag, value in {"--lr": args.lr, "--weight-decay": args.weight_decay}.items():
        if not 0 <= value < float("inf"):
            fail(f"{flag} {value} must be a finite number >= 0")
    for flag, value in {"--save-every": args.save_every, "--keep-last": args.keep_last,
                        "--max-skipped-steps": args.max_skipped_steps, "--tail": args.tail or 0,
                        "--export-every": args.export_every}.items():
        if value < 0:
            fail(f"{flag} {value} must be >= 0")
    if args.export_every and (not args.save_every or args.export_every % args.save_every):
        cadence = f"a multiple of --save-every {args.save_every}" if args.save_every else "with --save-every"
        fail(f"--export-every {args.export_every} exports saved checkpoints: give it {cadence}")
    if args.no_save and (args.export or args.export_every):
        fail("--export and --export-every export saved checkpoints, and --no-save saves none: drop one")
    if args.clip_overlap and (args.clip_norm is None or args.stream or args.dp > 1):
        fail("--clip-overlap keeps the resident trainer's update overlapped while clipping: it needs --clip-norm, and "
             "applies neither with --stream (whose updates wait for the norm) nor with --dp; drop it")
    if (args.tail or 0) > spec.n_layer:
        fail(f"--tail {args.tail}: {args.model} has only {spec.n_layer} blocks")
    t = args.tail_micro_batch
    if t is not None and (t < 1 or args.micro_batch and args.micro_batch % t):
        fail(f"--tail-micro-batch {t} must divide --micro-batch {args.micro_batch}")
    try:
        policy = RecomputePolicy.parse(args.recompute)
    except ValueError as e:
        fail(str(e))
    for flag, value in {"--gpu-mem-gib": args.gpu_mem_gib, "--host-mem-gib": args.host_mem_gib}.items():
        if value is not None and not value > 0:
            fail(f"{flag} {value} must be above 0")
    if wrong := lora.check(args, cfg):
        fail(wrong)
    composed = compose.composed(args)  # no memory plan: --gpu-mem-gib is enforced, --host-mem-gib the loop's guard
    if args.dp > 1 and args.gpu_mem_gib is not None and not (args.stream or composed):  # before any process starts
        try:  # the named rates: the ranks measure this machine's when they plan (LoRA: the adapted spec's bytes)
            search(ask(args, lora.model(args, cfg), pins),
                   Box(args.dp, int(args.gpu_mem_gib * GIB), None, StreamCosts(), 25e9))
        except MemoryError as e:
            fail(str(e))
    if args.gpu_mem_gib is not None and device.type != "cuda":
        fail(f"--gpu-mem-gib {args.gpu_mem_gib} caps GPU memory, but this run is on {device} (no CUDA GPU); leave "
             f"it out (--host-mem-gib caps host memory)")
    for source in (args.data, args.val_data):  # before any rank starts, not 20 s later in each one's build
        if source not in (None, STDLIB):
            try:
                source_file(source)
            except FileNotFoundError as e:
                fail(str(e))
    if composed:
        return
    if device.type != "cuda":  # no device plan: check the host one now
        micro = cpu_stream_micro_batch(args) if args.stream else args.micro_batch or args.batch // args.dp
        try:
            check_resident_host(args, cfg, micro, RecomputePolicy.parse("every") if args.stream else policy, False)
        except MemoryError as e:
            fail(str(e))


