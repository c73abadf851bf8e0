"""Packed against padded chat fine-tuning, in one run on one GPU: answer tokens per second, and the time of a
packed step against an unmasked step of the same shape (the mask's cost).

    python -m tasks.bench.pack --model llama-3.2-1b --seq 2048 --batch 8 --micro-batch 4 --out runs/bench_pack.json
    python -m tasks.bench.pack --model tiny --seq 256 --batch 4 --micro-batch 2      # CPU, seconds

A synthetic chat set of ``--examples`` conversations of 50-1,000 tokens (log-normal, mean about 300), the first
40% of each a prompt (untrained); random weights of the real shapes; bf16 compute with the optimizer state on the
device (the resident trainer, ``--compile`` for compiled blocks). The padded run is today's ``--no-pack``
(``ExampleLoader``), the packed one ``PackedLoader``; the unmasked step runs the packed rows' tokens with no
positions (every row one document: ``is_causal`` SDPA). Targets: packed >= 3x the padded answer tokens/s, and
a packed step within 5% of the unmasked one.
"""
from __future__ import annotations

import argparse
import time

import torch

from nanotrain.core.models import init_params, model_spec, preset
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.data.batches import ExampleLoader, PackedLoader
from nanotrain.data.chat import Example
from tasks.bench.common import save_json, sync

SMALL = ("tiny", "tiny-llama")  # the presets a CPU runs in seconds (their context stretched to --seq)


def chat_set(count: int, vocab: int, seed: int = 0, low: int = 50, high: int = 1000) -> list[Example]:
    """``count`` examples of ``low``..``high`` ids, log-normal lengths (median 250: mean about 300)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.empty(count).log_normal_(mean=5.52, std=0.6, generator=g).round().clamp(low, high).long()
    out = []
    for line, n in enumerate(lengths.tolist(), 1):
        trained = torch.arange(n) >= int(0.4 * n)
        out.append(Example(torch.randint(0, vocab, (n,), generator=g), trained, line))
    return out


def timed(trainer: ResidentTrainer, batches, steps: int, warmup: int) -> tuple[float, int]:
    """Seconds per step and answer tokens per step over ``steps`` batches after ``warmup``."""
    for batch in batches[:warmup]:
        trainer.step(*batch)
    sync()
    t0, tokens = time.perf_counter(), 0
    for batch in batches[warmup:warmup + steps]:
        tokens += trainer.step(*batch).tokens
    sync()
    return (time.perf_counter() - t0) / steps, tokens // steps


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--examples", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (recompute none)")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and args.model not in SMALL:
        ap.error(f"--model {args.model} on a CPU would take hours: run it on a GPU, or pass --model tiny")
    spec = model_spec(preset(args.model, **({"n_ctx": args.seq} if args.model in SMALL else {})))
    examples = chat_set(args.examples, spec.vocab_size)
    ocfg = OffloadConfig(device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32,
                         offload=False)
    tcfg = TrainConfig(batch=args.batch, micro_batch=args.micro_batch, compile=args.compile)
    trainer = ResidentTrainer(spec, init_params(spec, seed=0), tcfg, AdamConfig(lr=1e-5), ocfg)
    n = args.warmup + args.steps
    packed = PackedLoader(examples, args.seq, args.batch, pad_id=0)
    padded = ExampleLoader(examples, args.seq, args.batch, pad_id=0)
    print(f"packed: {packed.describe()}\npadded: {padded.describe()}", flush=True)
    packed_batches = [packed.next_batch() for _ in range(n)]
    rows = {"padded": timed(trainer, [padded.next_batch() for _ in range(n)], args.steps, args.warmup),
            "packed": timed(trainer, packed_batches, args.steps, args.warmup),
            "unmasked": timed(trainer, [b[:2] for b in packed_batches], args.steps, args.warmup)}
    trainer.close()
    result = {name: {"step_s": s, "answer_tokens_per_step": t, "answer_tokens_per_s": t / s}
              for name, (s, t) in rows.items()}
    speedup = result["packed"]["answer_tokens_per_s"] / result["padded"]["answer_tokens_per_s"]
    mask_cost = result["packed"]["step_s"] / result["unmasked"]["step_s"] - 1
    for name, r in result.items():
        print(f"{name:9s} {r['step_s'] * 1e3:9.1f} ms/step {r['answer_tokens_per_step']:8d} answer tokens/step "
              f"{r['answer_tokens_per_s']:12.0f} answer tokens/s", flush=True)
    print(f"packed / padded answer tokens/s: {speedup:.2f}x (target >= 3); packed step vs unmasked: "
          f"{mask_cost:+.1%} (target within 5%) on {torch.cuda.get_device_name() if cuda else 'cpu'}", flush=True)
    summary = {"model": args.model, "seq": args.seq, "batch": args.batch, "rows": result, "speedup": speedup,
               "mask_cost": mask_cost}
    if args.out:
        save_json(args.out, summary)
    return summary


if __name__ == "__main__":
    main()
