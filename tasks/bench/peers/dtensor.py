"""The tensor-parallel benchmark's peer: GPT-2 as an ``nn.Module`` under PyTorch DTensor.

Separate q/k/v ``Linear``s (DTensor's colwise plan shards each by heads), parallelized by
``parallelize_module`` with torchtitan's plan: q/k/v/fc colwise, proj/fc_proj rowwise, the
embedding rowwise, the tied head colwise with ``loss_parallel``, and with sequence parallelism
``SequenceParallel`` LayerNorms. At TP=1 it is the plain module, untouched. ``tests/test_tp_bench``
checks it computes our model.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanotrain.core.models.gpt2 import GPT2Config
from nanotrain.distributed import RankGrid
from nanotrain.tensor_parallel.shard import padded_vocab
from nanotrain.core.tree import Tree
def autocast(device: torch.device):
    """bf16 autocast on GPUs (fp32 weights), off on the CPU smoke test."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


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


def dtensor_step(full: Tree, cfg: GPT2Config, grid: RankGrid, sp: bool, tokens, targets, device, lr: float,
                 pad_vocab: bool = True, local_optimizer: bool = True, compile_blocks: bool = False):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import loss_parallel

    rows = padded_vocab(cfg.vocab_size, grid.tp) if pad_vocab else cfg.vocab_size
    peer = peer_from_tree(full, cfg, rows).to(device)
    tp = grid.tp
    if tp > 1:
        peer = parallelize_peer(peer, DeviceMesh.from_group(grid.tp_group, device.type), sp)
    if compile_blocks:  # as torchtitan does: each transformer block compiled, after parallelization
        for block in peer.blocks:
            block.compile()
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
            with autocast(device):
                loss = peer_loss(peer, tokens, targets)
            loss.backward()
        else:
            with autocast(device), loss_parallel():
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
    step.peer = peer  # what it trains: tests/tensor_parallel/test_tp_bench records the gradients applied
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
