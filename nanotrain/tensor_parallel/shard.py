"""How GPT-2's parameter tree is cut over a tensor-parallel group, applied from outside the model.

Every block tensor has one placement:

* heads: attention is split by heads. ``qkv_w`` is ``[3C, C]`` with rows q (all heads), k, v, so a
  rank keeps three row blocks, those of its heads in q, in k and in v; ``proj_w`` keeps the
  matching columns. Heads need not divide evenly: gpt2-xl's 25 heads go 13/12 on 2 ranks.
* neurons: the MLP's 4C hidden neurons, rows of ``fc_w``/``fc_b`` and columns of ``fc_proj_w``.
* replicated: LayerNorms, the row-parallel biases (added after the reduction), ``wpe``.

``wte`` is split by vocabulary rows, after padding the vocabulary with zero rows to a multiple of
``tp * vocab_multiple``: equal shards let logits be all-gathered, and each shard's GEMM is a
multiple of ``vocab_multiple`` wide (``nanotrain.loss.VOCAB_ALIGN``: 50257 columns push cuBLAS
onto slow kernels). Padding rows are never looked up (token ids are checked against the real
vocabulary) and their logits are masked to -inf in the loss, so they change neither the loss nor
any gradient; their own gradient is zero and AdamW keeps them at zero.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from nanotrain.models.gpt2 import GPT2Config
from nanotrain.loss import VOCAB_ALIGN
from nanotrain.distributed.grid import RankGrid
from nanotrain.tree import Tree

HEADS_ROWS, HEADS_COLS = "heads_rows", "heads_cols"
NEURON_ROWS, NEURON_COLS = "neuron_rows", "neuron_cols"
REPLICATED = "replicated"

BLOCK_PLACEMENT = {
    "ln_1_w": REPLICATED, "ln_1_b": REPLICATED,
    "qkv_w": HEADS_ROWS, "qkv_b": HEADS_ROWS,
    "proj_w": HEADS_COLS, "proj_b": REPLICATED,
    "ln_2_w": REPLICATED, "ln_2_b": REPLICATED,
    "fc_w": NEURON_ROWS, "fc_b": NEURON_ROWS,
    "fc_proj_w": NEURON_COLS, "fc_proj_b": REPLICATED,
}
TOP_REPLICATED = ("wpe", "ln_f_w", "ln_f_b")


def partition(n: int, parts: int, index: int) -> range:
    """Part ``index`` of ``range(n)`` cut into ``parts`` contiguous pieces differing by at most one."""
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return range(lo, lo + base + (index < extra))


def padded_vocab(vocab_size: int, tp: int, vocab_multiple: int) -> int:
    step = tp * vocab_multiple
    return -(-vocab_size // step) * step


@dataclass(frozen=True)
class TPPlan:
    """Which slice of GPT-2 this rank holds, and how its activations move."""
    cfg: GPT2Config
    grid: RankGrid
    sequence_parallel: bool
    heads: range         # this rank's attention heads
    neurons: range       # this rank's MLP hidden neurons
    vocab: range         # this rank's rows of the padded vocabulary
    padded_vocab: int
    overlap: bool = False  # collectives overlapped with the matmuls (``overlap``)
    compile: Any = None    # a torch.compile backend, e.g. "inductor": blocks in compiled regions (``compiled``)


def plan_gpt2(cfg: GPT2Config, grid: RankGrid, sequence_parallel: bool = False,
              vocab_multiple: int = VOCAB_ALIGN, overlap: bool = False, compile: Any = None) -> TPPlan:
    tp, rank = grid.tp, grid.tp_rank
    if cfg.n_head < tp:
        raise ValueError(f"tp={tp} is more than the model's {cfg.n_head} attention heads; use tp <= {cfg.n_head}")
    vocab = padded_vocab(cfg.vocab_size, tp, vocab_multiple)
    return TPPlan(cfg, grid, sequence_parallel, heads=partition(cfg.n_head, tp, rank),
                  neurons=partition(4 * cfg.n_embd, tp, rank), vocab=partition(vocab, tp, rank), padded_vocab=vocab,
                  overlap=overlap, compile=compile)


def token_range(n_tokens: int, plan: TPPlan) -> range:
    """This rank's tokens of the flat ``[B*T, C]`` activations: all of them, or its share with sequence parallelism."""
    if not plan.sequence_parallel:
        return range(n_tokens)
    tp = plan.grid.tp
    if n_tokens % tp:
        raise ValueError(f"sequence parallelism splits the {n_tokens} tokens of a batch over tp={tp} ranks; "
                         f"make batch * sequence length a multiple of {tp}")
    share = n_tokens // tp
    return range(plan.grid.tp_rank * share, (plan.grid.tp_rank + 1) * share)


def _shard_block_tensor(t: torch.Tensor, placement: str, plan: TPPlan) -> torch.Tensor:
    c, d = plan.cfg.n_embd, plan.cfg.head_dim
    heads = slice(plan.heads.start * d, plan.heads.stop * d)
    neurons = slice(plan.neurons.start, plan.neurons.stop)
    if placement == HEADS_ROWS:
        return torch.cat([t[j * c:(j + 1) * c][heads] for j in range(3)])
    if placement == HEADS_COLS:
        return t[:, heads]
    if placement == NEURON_ROWS:
        return t[neurons]
    if placement == NEURON_COLS:
        return t[:, neurons]
    return t


def shard_vocab(wte: torch.Tensor, plan: TPPlan) -> torch.Tensor:
    padding = wte.new_zeros((plan.padded_vocab - wte.shape[0], wte.shape[1]))
    return torch.cat([wte, padding])[plan.vocab.start:plan.vocab.stop]


def shard_leaf(path: str, t: torch.Tensor, plan: TPPlan) -> torch.Tensor:
    """This rank's slice of the leaf at ``path`` (``wte``, ``blocks.3.qkv_w``, ...), a fresh copy."""
    if path == "wte":
        return shard_vocab(t, plan).clone()
    if path in TOP_REPLICATED:
        return t.clone()
    return _shard_block_tensor(t, BLOCK_PLACEMENT[path.rsplit(".", 1)[1]], plan).clone()


def unshard_leaf(path: str, shards: Sequence[torch.Tensor], cfg: GPT2Config) -> torch.Tensor:
    """The whole leaf from its shards in TP-rank order: ``shard_leaf``'s inverse (padding rows dropped)."""
    if path == "wte":
        return torch.cat(list(shards))[:cfg.vocab_size]
    if path in TOP_REPLICATED:
        return shards[0]
    placement = BLOCK_PLACEMENT[path.rsplit(".", 1)[1]]
    if placement == HEADS_ROWS:  # each shard is its heads' rows of q, then of k, then of v
        parts = [s.chunk(3) for s in shards]
        return torch.cat([part[j] for j in range(3) for part in parts])
    if placement in (HEADS_COLS, NEURON_COLS):
        return torch.cat(list(shards), dim=1)
    if placement == NEURON_ROWS:
        return torch.cat(list(shards))
    return shards[0]


def shard_params(params: Tree, plan: TPPlan) -> Tree:
    """This rank's tree, same keys as the model's, each tensor a fresh copy of its slice.

    Copies, not views, so the full tree can be freed once every rank has its shard. Applied to
    a tree of full gradients it gives the gradients each rank must have (that is how the tests
    check exactness).
    """
    if len(params["blocks"]) != plan.cfg.n_layer or params["wte"].shape[0] != plan.cfg.vocab_size:
        raise ValueError(f"params do not match the plan's config: {len(params['blocks'])} blocks, "
                         f"vocab {params['wte'].shape[0]}; build the plan from the config the params came from")
    local = {name: params[name].clone() for name in TOP_REPLICATED}
    local["wte"] = shard_vocab(params["wte"], plan).clone()
    local["blocks"] = [{k: _shard_block_tensor(t, BLOCK_PLACEMENT[k], plan).clone() for k, t in b.items()}
                       for b in params["blocks"]]
    return {k: local[k] for k in params}


def replicated_leaves(local: Tree) -> list[torch.Tensor]:
    """The tensors every rank holds whole, in a fixed order (same on every rank of the TP group).

    ``local`` may be a pipeline stage's part of the tree: leaves it lacks (None, or absent from a
    block) are skipped, and the ranks of a TP group hold the same stages, so the same leaves.
    """
    out = [local[name] for name in TOP_REPLICATED]
    for b in local["blocks"]:
        out += [b.get(k) for k, placement in BLOCK_PLACEMENT.items() if placement == REPLICATED]
    return [t for t in out if isinstance(t, torch.Tensor)]
