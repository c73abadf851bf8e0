"""Tensor-parallel GPT-2 training steps: nanotrain's engine against PyTorch DTensor, in one run.

    torchrun --nproc_per_node 4 -m tasks.bench_tp --out runs/bench_tp.json
    torchrun --nproc_per_node 2 -m tasks.bench_tp --tp 1,2 --out runs/bench_tp_2gpu.json

For each TP size (ranks 0..tp-1 work, the others wait), with and without sequence parallelism:

* ``nanotrain``: the parameter tree sharded by ``shard_params``, ``parallel_loss`` (vocab-parallel
  cross-entropy), ``sync_grads``.
* ``dtensor``: the same model as an ``nn.Module`` with separate q/k/v ``Linear``s, parallelized by
  ``parallelize_module`` with the usual plan (torchtitan's): q/k/v/fc colwise, proj/fc_proj
  rowwise, the embedding rowwise, the tied head colwise with ``loss_parallel``, and with sequence
  parallelism ``SequenceParallel`` LayerNorms. At TP=1 it is the plain module, untouched.

Both start from the same weights, take a full step (forward, backward, AdamW) under bf16 autocast
with fp32 weights, dropout off. Reported: tokens/s, MFU over the TP group, peak memory (the
largest of the group), scaling efficiency (tokens/s over tp times the same engine's TP=1), and
the first step's loss as a check that both compute the same model.

gpt2-xl has 25 heads, which 2 and 4 ranks cannot share evenly. nanotrain splits heads unevenly
(13/12, 7/6/6/6), but DTensor's colwise q/k/v would cut a head in half, so by default both run
``--n-head 20`` (head size 80): every weight has gpt2-xl's shape and the FLOPs are the same.
``--n-head 25`` runs the real head count, for nanotrain alone at TP>1.
"""
from __future__ import annotations

import argparse
import gc
import os
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from nanotrain import model as M
from nanotrain.benchmark import Row, device_name, peak_gib, reset_peak, sync, time_steps, write_json
from nanotrain.config import GPT2Config
from nanotrain.flops import mfu, peak_flops
from nanotrain.loss import VOCAB_ALIGN
from nanotrain.tensor_parallel import (GridConfig, RankGrid, build_grid, parallel_loss, plan_gpt2, shard_params,
                                       sync_grads)
from nanotrain.tensor_parallel.shard import padded_vocab
from nanotrain.tree import Tree, named_leaves, tree_map
from weights import load_weights

# ---------------------------------------------------------------------------------------------
# The peer: GPT-2 as an nn.Module, so that DTensor's parallelize_module can take it.


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        c = cfg.n_embd
        self.head_dim = cfg.head_dim
        self.q, self.k, self.v, self.proj = (nn.Linear(c, c) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        # Colwise q/k/v return local tensors holding this rank's heads: -1 is the local head count.
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.fc, self.proj = nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps), Attention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embeddings(nn.Module):
    def __init__(self, cfg: GPT2Config, vocab_rows: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_rows, cfg.n_embd), nn.Embedding(cfg.n_ctx, cfg.n_embd)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))


class PeerGPT2(nn.Module):
    def __init__(self, cfg: GPT2Config, vocab_rows: int):
        super().__init__()
        self.emb = Embeddings(cfg, vocab_rows)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.head = nn.Linear(cfg.n_embd, vocab_rows, bias=False)
        self.head.weight = self.emb.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def peer_from_tree(params: Tree, cfg: GPT2Config, vocab_rows: int | None = None) -> PeerGPT2:
    """The nn.Module holding the tree's weights (fused qkv split into q, k, v).

    ``vocab_rows`` above the vocabulary adds zero rows to the tied embedding, Megatron's padding:
    aligned GEMMs, but unlike nanotrain's loss the padding logits (0) enter the softmax, which
    changes the loss by about log(1 + padding / vocab).
    """
    peer = PeerGPT2(cfg, vocab_rows or cfg.vocab_size)
    c = cfg.n_embd
    with torch.no_grad():
        peer.emb.wte.weight.zero_()
        peer.emb.wte.weight[:cfg.vocab_size] = params["wte"]
        peer.emb.wpe.weight.copy_(params["wpe"])
        peer.ln_f.weight.copy_(params["ln_f_w"])
        peer.ln_f.bias.copy_(params["ln_f_b"])
        for blk, p in zip(peer.blocks, params["blocks"]):
            for j, lin in enumerate((blk.attn.q, blk.attn.k, blk.attn.v)):
                lin.weight.copy_(p["qkv_w"][j * c:(j + 1) * c])
                lin.bias.copy_(p["qkv_b"][j * c:(j + 1) * c])
            pairs = ((blk.ln_1, "ln_1"), (blk.ln_2, "ln_2"), (blk.attn.proj, "proj"), (blk.mlp.fc, "fc"),
                     (blk.mlp.proj, "fc_proj"))
            for mod, name in pairs:
                mod.weight.copy_(p[f"{name}_w"])
                mod.bias.copy_(p[f"{name}_b"])
    return peer


def parallelize_peer(peer: PeerGPT2, mesh, sequence_parallel: bool) -> PeerGPT2:
    """torchtitan's TP plan, adapted to GPT-2's learned positions and tied head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    sp = sequence_parallel
    between = Shard(1) if sp else Replicate()  # the residual stream's layout between blocks
    plan = {"emb.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        # wte's output plus the replicated positions, cut to this rank's sequence shard.
        plan["emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        plan["ln_f"] = SequenceParallel()
    for i in range(len(peer.blocks)):
        b = f"blocks.{i}"
        plan.update({f"{b}.attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
        plan.update({f"{b}.attn.proj": RowwiseParallel(output_layouts=between), f"{b}.mlp.fc": ColwiseParallel(),
                     f"{b}.mlp.proj": RowwiseParallel(output_layouts=between)})
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan.update({f"{b}.ln_1": SequenceParallel(), f"{b}.ln_2": SequenceParallel(), f"{b}.attn": gather,
                         f"{b}.mlp": gather})
    parallelize_module(peer, mesh, plan)
    # Both plans shard the shared [vocab, C] weight by rows (Shard(0)) but each makes its own
    # Parameter; tie them again so the head and the embedding train one tensor.
    peer.head.weight = peer.emb.wte.weight
    return peer


def peer_loss(peer: PeerGPT2, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; on vocab-sharded DTensor logits call it, and backward, inside ``loss_parallel()``."""
    return F.cross_entropy(peer(tokens).flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------------------------------------
# One training step of each engine.


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def nanotrain_step(full: Tree, cfg: GPT2Config, grid: RankGrid, sp: bool, tokens, targets, device, lr: float):
    plan = plan_gpt2(cfg, grid, sequence_parallel=sp)
    local = tree_map(lambda t: t.to(device).requires_grad_(), shard_params(full, plan))
    opt = torch.optim.AdamW([t for _, t in named_leaves(local)], lr=lr, foreach=True)

    def step() -> torch.Tensor:
        with _autocast(device):
            loss = parallel_loss(local, tokens, targets, plan)
        loss.backward()
        sync_grads(local, plan)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def dtensor_step(full: Tree, cfg: GPT2Config, grid: RankGrid, sp: bool, tokens, targets, device, lr: float,
                 pad_vocab: bool = True, local_optimizer: bool = True):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import loss_parallel

    rows = padded_vocab(cfg.vocab_size, grid.tp, VOCAB_ALIGN) if pad_vocab else cfg.vocab_size
    peer = peer_from_tree(full, cfg, rows).to(device)
    tp = grid.tp
    if tp > 1:
        peer = parallelize_peer(peer, DeviceMesh.from_group(grid.tp_group, device.type), sp)
    params = list(peer.parameters())
    if local_optimizer:
        # AdamW on each rank's shards as plain tensors, as ours runs: through DTensor's dispatch every
        # foreach op pays sharding propagation per parameter, a CPU cost that is the optimizer's, not
        # tensor parallelism's. Gradients are brought to their parameter's layout first (with
        # sequence parallelism a replicated LayerNorm's gradient arrives as a partial sum).
        shards = [_local(p) for p in params]
        opts = [torch.optim.AdamW(shards, lr=lr, foreach=True)]
    else:
        # torch's foreach kernels do not take DTensors and plain tensors in one list, and without
        # sequence parallelism the LayerNorms stay plain tensors.
        is_dt = [_is_dtensor(p) for p in params]
        groups = [[p for p, d in zip(params, is_dt) if d == want] for want in (True, False)]
        opts = [torch.optim.AdamW(g, lr=lr, foreach=True) for g in groups if g]

    def step() -> torch.Tensor:
        if tp == 1:
            with _autocast(device):
                loss = peer_loss(peer, tokens, targets)
            loss.backward()
        else:
            with _autocast(device), loss_parallel():
                loss = peer_loss(peer, tokens, targets)
                loss.backward()
        if local_optimizer:
            for shard, p in zip(shards, params):
                if shard is not p:
                    shard.grad, p.grad = _local(p.grad, like=p), None
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    return step


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _local(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """The plain tensor holding this rank's part of ``t`` (``t`` itself if not a DTensor), in the
    placements of ``like`` when given."""
    if not _is_dtensor(t):
        return t
    if like is not None and t.placements != like.placements:
        t = t.redistribute(like.device_mesh, like.placements)
    with torch.no_grad():  # without autograd, to_local() is the local tensor itself, not a view of it
        return t.to_local()


ENGINES = ("nanotrain", "dtensor")


# ---------------------------------------------------------------------------------------------


def measure(engine: str, full: Tree, cfg: GPT2Config, grid: RankGrid, sp: bool, args, device) -> Row:
    """One configuration on the ranks of ``grid``: first step's loss, then timed steps and peak memory."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)
    targets = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)
    if engine == "nanotrain":
        step = nanotrain_step(full, cfg, grid, sp, tokens, targets, device, args.lr)
    else:
        step = dtensor_step(full, cfg, grid, sp, tokens, targets, device, args.lr, args.peer_vocab == "padded",
                            args.peer_optimizer == "local")
    # Peak memory of training alone: the DTensor peer is built whole on the GPU, then sharded.
    reset_peak()
    first_loss = float(step())
    if args.profile:
        profile(f"{engine} tp={grid.tp} sp={sp}", step)
    dt = time_steps(step, args.warmup, args.steps)
    peak = torch.tensor([peak_gib()], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=grid.tp_group)
    tok_s = args.batch * args.seq / dt
    util = mfu(tok_s, cfg, args.seq, peak_flops(device_name()))
    name = f"{engine} tp={grid.tp}{' sp' if sp else ''}"
    return Row(name, args.batch / dt, tok_s, None if util is None else util / grid.tp, float(peak),
               {"engine": engine, "tp": grid.tp, "sp": sp, "first_loss": first_loss, "step_s": dt})


def profile(name: str, step) -> None:
    """Kernel times of two steps; every rank steps (they talk), rank 0 prints."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with torch_profile(activities=activities) as prof:
        for _ in range(2):
            step()
        sync()
    if dist.get_rank() == 0:
        print(f"\n== profile: {name} ==")
        print(prof.key_averages().table(sort_by="self_cuda_time_total" if torch.cuda.is_available()
                                        else "self_cpu_time_total", row_limit=25, max_name_column_width=70))


def print_rows(rows: list[Row]) -> None:
    base = {r.extra["engine"]: r.tokens_per_s for r in rows if r.extra["tp"] == 1}
    print(f"{'config':22s} {'tok/s':>9s} {'tok/s/GPU':>10s} {'MFU':>6s} {'peak GiB':>9s} {'efficiency':>10s} "
          f"{'loss@0':>8s}")
    for r in rows:
        tp = r.extra["tp"]
        eff = r.tokens_per_s / (tp * base[r.extra["engine"]]) if r.extra["engine"] in base else float("nan")
        r.extra["efficiency"] = eff
        mfu_s = f"{100 * r.mfu:5.1f}%" if r.mfu is not None else "  n/a"
        print(f"{r.name:22s} {r.tokens_per_s:9.0f} {r.tokens_per_s / tp:10.0f} {mfu_s:>6s} {r.peak_gib:9.2f} "
              f"{100 * eff:9.1f}% {r.extra['first_loss']:8.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-xl")
    ap.add_argument("--n-head", type=int, default=20, help="heads (gpt2-xl has 25; see above)")
    ap.add_argument("--tp", default="1,2,4", help="TP sizes, each at most the number of ranks")
    ap.add_argument("--engines", default="nanotrain,dtensor")
    ap.add_argument("--sp", default="off,on", help="sequence parallelism: off, on or off,on")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--peer-vocab", choices=["padded", "exact"], default="padded",
                    help="DTensor peer's vocabulary: padded like ours to a multiple of 64 per rank (fast GEMMs, "
                         "padding logits in its softmax) or exactly 50257 (slow cuBLAS kernels)")
    ap.add_argument("--peer-optimizer", choices=["local", "dtensor"], default="local",
                    help="DTensor peer's AdamW: on each rank's local shards (as ours) or on the DTensors themselves "
                         "(every foreach op through DTensor's dispatch, a CPU cost per parameter)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--weights", default="random", help="'random' (seeded checkpoint in HF layout), 'init' "
                    "(init_params in memory, no file) or a model.safetensors path")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo, a smoke test only")
    ap.add_argument("--profile", action="store_true", help="print a kernel-time table per configuration (rank 0)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()

    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun, e.g. torchrun --nproc_per_node 4 -m tasks.bench_tp")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_tp measures GPUs: no CUDA device here (--device cpu runs a smoke test)")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    tps = [int(t) for t in args.tp.split(",")]
    engines = args.engines.split(",")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"unknown engine {unknown[0]!r} (known: {', '.join(ENGINES)})")
    if max(tps) > world:
        raise SystemExit(f"--tp {args.tp} asks for {max(tps)} ranks but torchrun started {world}; "
                         f"use --nproc_per_node {max(tps)} or smaller TP sizes")
    cfg = replace(GPT2Config.from_name(args.model), n_head=args.n_head)
    full = load_full(args, cfg)
    grids = {tp: build_grid(GridConfig(tp=tp), ranks=range(tp)) for tp in tps}  # collective: all ranks, all grids
    rows: list[Row] = []
    for tp in tps:
        for sp in ([False] if tp == 1 else [s == "on" for s in args.sp.split(",")]):
            for engine in engines:
                if engine == "dtensor" and cfg.n_head % tp:
                    if rank == 0:
                        print(f"skip dtensor tp={tp}: {cfg.n_head} heads do not split over {tp} ranks", flush=True)
                    continue
                if grids[tp] is not None:
                    gc.collect()  # the last configuration's modules and optimizer states, cycles included
                    row = measure(engine, full, cfg, grids[tp], sp, args, device)
                    if rank == 0:
                        rows.append(row)
                        print(f"  {row.name}: {row.tokens_per_s:.0f} tok/s, peak {row.peak_gib:.1f} GiB", flush=True)
                dist.barrier()
    if rank == 0:
        print(f"\n{args.model} ({cfg.n_head} heads), batch {args.batch} x {args.seq}, {device_name()}, "
              f"{world} ranks; efficiency = tok/s / (tp x same engine's tok/s at tp=1)")
        print_rows(rows)
        write_json(args.out, rows, command="tasks.bench_tp", model=args.model, n_head=cfg.n_head, batch=args.batch,
                   seq=args.seq, world=world)
    dist.destroy_process_group()


def load_full(args, cfg: GPT2Config) -> Tree:
    """The full fp32 tree on the CPU, the same on every rank; rank 0 writes a random checkpoint first."""
    if args.weights == "init":
        return M.init_params(cfg, seed=0)
    if dist.get_rank() == 0:
        full = load_weights(args.weights, args.model, cfg)  # 'random' writes the file once, before anyone reads it
    dist.barrier()
    return full if dist.get_rank() == 0 else load_weights(args.weights, args.model, cfg)


if __name__ == "__main__":
    main()
