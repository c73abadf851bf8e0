"""Weight streaming against the resident trainer on a GPU, in bf16 (the CPU tests check fp32 exactly).

    python -m tasks.bench.stream_check --model gpt2 --layers 6 --steps 5 --out runs/stream_check.json

Both trainers start from the same random weights and train on the same batch of random tokens
with the same AdamW; the streamed one keeps ``--on-host`` block inputs in host memory. bf16
compute rounds differently in the two orders of work (whole batch per block, against the
micro-batches one after the other through the whole model), so the check is a bound, printed with
the measured values: losses within 1%, every first-step gradient within 1% relative (norm of the
difference over the norm), and every master weight moved from its initial value in host memory
(lost updates barely move 5 steps' losses at lr 1e-4: a write-back race passed the other bounds).
The weights' differences and those of their updates (master minus initial) are printed, not bounded.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from nanotrain.core.models import init_params, model_spec, preset
from nanotrain.core.models.spec import ModelSpec
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.stream.trainer import StreamConfig, StreamTrainer
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.core.tree import get_path, named_leaves
from tasks.bench.common import need_cuda, save_json

TOLERANCE = 1e-2


def key_bias_rows(spec: ModelSpec) -> tuple[str, int, int] | None:
    """(block leaf, first row, end row) of the key bias in a fused q/k/v bias (its second of three segments), or
    None. It adds one score to every key of a query, which softmax ignores: its true gradient is 0 and the
    computed one rounding noise (tests/core/test_trainer.py), so its weight differences say nothing."""
    q, kv, d = spec.heads
    for key, path in zip(spec.block_keys, spec.block_units[0].paths):
        leaf = spec.leaf(path)
        if key in spec.attn_keys and len(leaf.shape) == 1 and len(leaf.placement.segments) == 3:
            return key, q * d, (q + kv) * d
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--on-host", type=int, default=2)
    ap.add_argument("--adam-bits", type=int, default=32, choices=[8, 32])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    need_cuda("tasks.bench.stream_check (bf16 on a GPU against the resident trainer)",
              "pytest tests/stream/test_streaming.py")
    cfg = preset(args.model, n_layer=args.layers)
    spec = model_spec(cfg)
    ocfg = OffloadConfig(device="cuda", dtype=torch.bfloat16, state_bits=args.adam_bits, keep_32bit=spec.fp32_moments)
    adam = AdamConfig(lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, spec.vocab_size, (args.batch, args.seq), generator=g)
    y = x.roll(-1, dims=1)
    init = dict(named_leaves(init_params(cfg, seed=0)))
    resident = ResidentTrainer(cfg, init_params(cfg, seed=0), TrainConfig(args.batch, args.micro_batch, "every"),
                               adam, ocfg)
    streamed = StreamTrainer(cfg, init_params(cfg, seed=0), StreamConfig(args.batch, args.micro_batch, args.on_host),
                             adam, ocfg)
    first = {}  # the streamed trainer's first-step gradients, as handed to its updates
    update = streamed.opt.update

    def keep_first(slot, grads):
        if streamed.opt.steps == 0:
            first.update({path: g.float().clone() for path, g in zip(slot.unit.paths, grads)})
        update(slot, grads)

    streamed.opt.update = keep_first
    losses = [(resident.step(x, y).loss, streamed.step(x, y).loss)]
    grad_errs = {path: ((first[path] - g).norm() / g.norm()).item() for path, g in resident.weights.accum.items()}
    losses += [(resident.step(x, y).loss, streamed.step(x, y).loss) for _ in range(args.steps - 1)]
    resident.opt.synchronize()
    a, b = resident.master_params(), streamed.master_params()
    key_bias = key_bias_rows(spec)
    errs, update_errs = {}, {}
    stale = [path for path, t in named_leaves(b) if torch.equal(t, init[path])]
    for path, t in named_leaves(a):
        s, t0 = get_path(b, path), init[path]
        if key_bias and path.endswith("." + key_bias[0]):
            lo, hi = key_bias[1:]
            t, s, t0 = (torch.cat([v[:lo], v[hi:]]) for v in (t, s, t0))
        errs[path] = ((s - t).norm() / t.norm()).item()
        update_errs[path] = ((s - t).norm() / (t - t0).norm()).item()
    worst_path = max(errs, key=errs.get)
    worst_loss = max(abs(r - s) / abs(r) for r, s in losses)
    for step, (r, s) in enumerate(losses, 1):
        print(f"step {step}: resident {r:.5f}  streamed {s:.5f}")
    for path in sorted(errs, key=errs.get)[-5:]:
        print(f"  {path}: {errs[path]:.2e}")
    print(f"worst loss difference {worst_loss:.2e}, worst weight difference {errs[worst_path]:.2e} ({worst_path}); "
          f"bound {TOLERANCE:.0e}")
    worst_update = max(update_errs, key=update_errs.get)
    print(f"updates (master - initial): worst difference {update_errs[worst_update]:.2e} ({worst_update}); "
          f"masters never updated: {len(stale)}{' ' + ', '.join(stale[:4]) if stale else ''}")
    worst_grad = max(grad_errs, key=grad_errs.get)
    print(f"first-step gradients: worst {grad_errs[worst_grad]:.2e} ({worst_grad}); bound {TOLERANCE:.0e}")
    ok = worst_loss <= TOLERANCE and grad_errs[worst_grad] <= TOLERANCE and not stale
    if args.out:
        save_json(args.out, {"args": vars(args) | {"out": str(args.out)}, "losses": losses, "worst_loss": worst_loss,
                             "worst_weight": errs[worst_path], "worst_grad": grad_errs[worst_grad],
                             "worst_grad_path": worst_grad, "worst_path": worst_path,
                             "worst_update": update_errs[worst_update], "never_updated": stale, "ok": ok})
    resident.close()
    streamed.close()
    if not ok:
        raise SystemExit(f"streaming differs from the resident trainer: {len(stale)} masters never updated" if stale
                         else f"streaming differs from the resident trainer by more than {TOLERANCE:.0e}")
    print("OK")


if __name__ == "__main__":
    main()
