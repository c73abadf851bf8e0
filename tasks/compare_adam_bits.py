"""8-bit against 32-bit Adam moments: two runs of the same fine-tuning on the same batches.

    python -m tasks.compare_adam_bits --model tiny --steps 60 --data ../shared/data/tinyshakespeare.txt \\
        --tokenizer-dir ../shared/data/gpt2-tokenizer

Both runs start from the same weights and see the same batches in the same order; only the
optimizer's moment storage differs (block-wise 8-bit dynamic code vs fp32). Writes
``OUT/adam_bits.json`` and ``OUT/adam_bits.png`` (both curves).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from nanotrain.models import init_params, model_spec
from nanotrain.cli import add_model_args, fail, model_config, pick_device, tokenizer_dir
from nanotrain.data import BlockLoader, load_tokens
from nanotrain.optim import AdamConfig, OffloadConfig
from nanotrain.monitor import StdoutSink
from nanotrain.plot import plot_curves
from nanotrain.tokenizer import TokenizerError, get_tokenizer
from nanotrain.train import loop
from nanotrain.train.loop import LoopConfig
from nanotrain.train.resident import ResidentTrainer, TrainConfig


def run(cfg, bits: int, args, tokens: torch.Tensor, device: torch.device) -> list[float]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # 8-bit moments for every tensor that has a full quantization block, as the GPU runs would use.
    ocfg = OffloadConfig(device=str(device), dtype=dtype, state_bits=bits, min_8bit_numel=2048,
                         keep_32bit=model_spec(cfg).fp32_moments)
    trainer = ResidentTrainer(cfg, init_params(cfg, seed=args.seed), TrainConfig(args.batch, args.batch),
                              AdamConfig(lr=args.lr, weight_decay=0.0), ocfg)
    loader = BlockLoader(tokens, args.seq, args.batch, seed=args.seed)
    records = loop.run(trainer, loader.next_batch, LoopConfig(args.steps, args.batch, args.seq),
                       [StdoutSink(10, f"  {bits}-bit ")], device)
    trainer.close()
    return [r["loss"] for r in records]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, default_model="tiny", default_weights="random")
    ap.add_argument("--data", default="stdlib")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", type=Path, default=Path("runs/adam_bits"))
    args = ap.parse_args(argv)
    cfg = model_config(args.model)
    device = pick_device(args.device)
    try:
        tokens = load_tokens(args.data, get_tokenizer(tokenizer_dir(args.tokenizer_dir)))
    except (TokenizerError, FileNotFoundError, ValueError) as e:
        fail(str(e))
    curves = {}
    for bits in (32, 8):
        print(f"{args.model}, {bits}-bit Adam moments, batch {args.batch} x {args.seq}, {args.steps} steps", flush=True)
        curves[f"{bits}-bit moments"] = run(cfg, bits, args, tokens, device)
    a, b = curves["32-bit moments"], curves["8-bit moments"]
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    print(f"largest relative loss difference over {args.steps} steps: {100 * worst:.2f}% "
          f"(final {a[-1]:.4f} vs {b[-1]:.4f})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adam_bits.json").write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                                         "curves": curves}, indent=1))
    plot_curves(curves, args.out / "adam_bits.png",
                f"{args.model}: AdamW with 32-bit vs 8-bit moments, same batches")


if __name__ == "__main__":
    main()
