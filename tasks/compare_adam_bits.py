"""8-bit against 32-bit Adam moments: two runs of the same fine-tuning on the same batches.

    python -m tasks.compare_adam_bits --model tiny --steps 60 --data ../shared/data/tinyshakespeare.txt \\
        --tokenizer-dir ../shared/data/gpt2-tokenizer

Both runs go through the one run path (``tasks.finetune --adam-bits 32``, then ``8``, each into its run folder
``OUT/32-bit``, ``OUT/8-bit``): the same weights, the same batches in the same order; only the optimizer's moment
storage differs (block-wise 8-bit dynamic code vs fp32). Writes ``OUT/adam_bits.json`` and ``OUT/adam_bits.png``
(both curves).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from nanotrain.run.cli import add_model_args
from nanotrain.monitor.plot import plot_curves
from tasks.demos import loop as demo
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
    flags = demo.lm_flags(args, ("model", "weights", "tokenizer_dir", "device", "seed", "data", "batch", "seq",
                                  "steps", "lr"))
    curves = {}
    for bits in (32, 8):
        print(f"{args.model}, {bits}-bit Adam moments, batch {args.batch} x {args.seq}, {args.steps} steps", flush=True)
        run = demo.run_path([*flags, "--micro-batch", str(args.batch), "--adam-bits", str(bits)],
                             args.out / f"{bits}-bit")
        curves[f"{bits}-bit moments"] = run["loss"]
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
