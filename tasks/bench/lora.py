"""LoRA and QLoRA on one GPU beside PEFT + transformers, in one call.

    python -m tasks.bench.lora --model llama-3.1-8b --gpu-mem-gib 24 --rows ours-lora,ours-lora-stream,peft-lora
    python -m tasks.bench.lora --model llama-3.1-8b --gpu-mem-gib 8 --rows ours-lora-stream,ours-qlora-stream --on-host 24
    python -m tasks.bench.lora --model llama-3.1-70b --gpu-mem-gib 24 --rows ours-qlora-stream --batch 8
    python -m tasks.bench.lora --model tiny-llama --device cpu --steps 2 --seq 64  # seconds on a CPU: the paths run

Rows (rank ``--rank`` on ``--targets``, batch ``--batch`` x ``--seq`` a step, AdamW on the pairs):
- ``ours-lora`` / ``ours-qlora``: the resident trainer, the base in bf16 / NF4 (recompute ``--recompute``);
- ``ours-lora-stream`` / ``ours-qlora-stream``: the streamed trainer, the base travelling block by block
  (``--on-host`` block inputs in host memory);
- ``peft-lora``: PEFT on transformers' bf16 model with gradient checkpointing, torch's fused AdamW on the pairs
  (what a user without nanotrain runs);
- ``peft-qlora``: the same over bitsandbytes' NF4 base (``Linear4bit``, double-quantised scales, bf16 compute).
  transformers quantises only while loading a checkpoint (``from_pretrained``) and these weights are random and
  never written, so each block's linear layers are swapped for ``Linear4bit`` and quantised on the GPU one at a time.
The first PEFT row in ``--rows`` is the table's baseline.
Weights are random, of the real shapes, drawn once per shape and shared by every block (speed does not depend on
the values; a 70B model's fp32 draw would not fit the host).
MFU counts what LoRA computes: the forward and the input gradients of the frozen base (4 FLOPs a weight a token,
not 6) and the attention. A model over a billion parameters refuses the CPU. A row that fails prints its error.
"""
from __future__ import annotations

import argparse
import traceback

import torch

from nanotrain.core.flops import peak_flops
from nanotrain.core.machine import set_gpu_cap
from nanotrain.core.models import model_spec, preset, run
from nanotrain.core.models.lora import LoraConfig, with_lora
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.stream.trainer import StreamConfig, StreamTrainer
from tasks.bench.common import Row, device_name, free_memory, peak_gib, print_table, reset_peak, time_steps
from tasks.bench.peers.hf import blocks, hf_model

ROWS = ("ours-lora", "ours-qlora", "ours-lora-stream", "ours-qlora-stream", "peft-lora", "peft-qlora")


def shared_params(spec) -> dict:
    """Random weights of ``spec``'s shapes, one draw per shape shared by every leaf of it (fresh pairs, PEFT's init)."""
    draws: dict = {}
    pairs = dict(run.init_stream(spec, trainable_only=True))
    return run.tree_from(spec, ((leaf.path, pairs[leaf.path] if leaf.trainable else draws.setdefault(
        leaf.shape, torch.randn(leaf.shape) * 0.02 if len(leaf.shape) == 2 else torch.ones(leaf.shape)))
        for leaf in spec.leaves))


def ours(name: str, spec, args, device: str):
    """One training step of our trainer for row ``name``."""
    ocfg = OffloadConfig(device=device, dtype=torch.bfloat16 if device != "cpu" else torch.float32,
                         base_bits=4 if "qlora" in name else 16)
    params = shared_params(spec)
    if name.endswith("stream"):
        scfg = StreamConfig(batch=args.batch, micro_batch=args.micro_batch, on_host=args.on_host)
        trainer = StreamTrainer(spec, params, scfg, AdamConfig(lr=1e-4), ocfg)
    else:
        tcfg = TrainConfig(batch=args.batch, micro_batch=args.micro_batch, recompute=args.recompute)
        trainer = ResidentTrainer(spec, params, tcfg, AdamConfig(lr=1e-4), ocfg)
    tokens = torch.randint(0, spec.vocab_size, (args.batch, args.seq))
    return lambda: trainer.step(tokens, tokens.roll(-1, 1))


def bnb_nf4(model, device: str):
    """``model`` with each block's ``nn.Linear`` as bitsandbytes' ``Linear4bit`` (NF4, double-quantised), the bf16
    weight quantised where it lies as it moves to ``device`` and then dropped: one matrix at a time."""
    import bitsandbytes as bnb

    for block in blocks(model):
        for name, lin in [(n, m) for n, m in block.named_modules() if type(m) is torch.nn.Linear]:
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta",
                                  compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4")
            q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, compress_statistics=True,
                                         quant_type="nf4")
            q.bias = lin.bias
            parent, _, child = name.rpartition(".")
            setattr(block.get_submodule(parent) if parent else block, child, q.to(device))
    return model


def peft(spec, args, device: str, bits: int = 16):
    """PEFT's LoRA on transformers' model: bf16 (or its blocks' matrices in NF4 with ``bits`` 4, bitsandbytes'),
    gradient checkpointing, fused AdamW over the pairs."""
    import peft as peft_lib

    from weights.peft import module

    model = hf_model(spec.cfg, recompute=True, device=device, dtype=torch.bfloat16 if device != "cpu" else torch.float32)
    if bits == 4:
        model = bnb_nf4(model, device)
    model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad (PEFT's recipe)
    lcfg = peft_lib.LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                               target_modules=[module(spec, a) for a in spec.adapters])
    model = peft_lib.get_peft_model(model, lcfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=device != "cpu")
    tokens = torch.randint(0, spec.vocab_size, (args.batch, args.seq), device=device)

    def step() -> None:
        for micro in tokens.split(args.micro_batch):
            (model(input_ids=micro, labels=micro, use_cache=False).loss * micro.shape[0] / args.batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", help="a preset (llama-3.1-70b: its shapes)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q,k,v,o,gate,up,down")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=1,  # 8B, one micro-batch of 8 x 2048: out of 24 GiB (H100)
                    help="sequences a pass (the rows run no planner: what fits is the caller's to say)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--recompute", default="every", help="the resident rows' policy")
    ap.add_argument("--on-host", type=int, default=0, help="the streamed rows' block inputs in host memory")
    ap.add_argument("--gpu-mem-gib", type=float, default=None, help="cap on GPU memory, enforced")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    base = preset(args.model)
    spec = with_lora(model_spec(base), LoraConfig(args.rank, 2.0 * args.rank, tuple(args.targets.split(","))))
    if args.device == "cpu" and spec.costs.total_params > 1e9:
        raise SystemExit(f"error: {args.model} ({spec.costs.total_params / 1e9:.1f}B parameters) is a GPU benchmark; "
                         f"on a CPU run a small model (--model tiny-llama)")
    if args.gpu_mem_gib is not None:
        set_gpu_cap(args.gpu_mem_gib)
    peak = peak_flops(device_name()) if args.device != "cpu" else None
    rows = []
    for name in args.rows.split(","):
        print(f"{name}: building and timing {args.steps} steps", flush=True)  # an 8B row takes minutes
        try:
            step = (peft(spec, args, args.device, 4 if "qlora" in name else 16) if name.startswith("peft")
                    else ours(name, spec, args, args.device))
            reset_peak()
            seconds = time_steps(step, 1, args.steps)
            tok_s = args.batch * args.seq / seconds
            util = None if peak is None else tok_s * spec.costs.flops_per_token(args.seq) / peak  # 4 a frozen weight
            rows.append(Row(name, args.batch / seconds, tok_s, util, peak_gib()))
            print(f"{name}: {rows[-1].seq_per_s:.2f} seq/s, peak {rows[-1].peak_gib:.2f} GiB", flush=True)  # as it ends
        except Exception:  # noqa: BLE001 (a row that fails says why; the others still run)
            print(f"{name} failed:\n{traceback.format_exc()}", flush=True)
        step = None
        free_memory()
    print(f"{args.model} LoRA rank {args.rank} on {args.targets}, batch {args.batch} x {args.seq}, "
          f"{device_name()}, GPU cap {args.gpu_mem_gib} GiB")
    print_table(rows, baseline=next((r.name for r in rows if r.name.startswith("peft")), None))


if __name__ == "__main__":
    main()
