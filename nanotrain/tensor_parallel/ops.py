"""``TPOps``: the ops of ``models.ops`` on this rank's tensor-parallel shard, so any family's block runs split.

Attention splits heads, the MLP splits neurons (each one all-reduce in forward and one in backward), the
token embedding and the head split the vocabulary. Activations between those regions are flat
``[tokens, C]``: all ``B*T`` tokens on every rank, or with sequence parallelism (Korthikanti et al. 2022)
this rank's contiguous ``B*T/tp`` tokens, on which the norms, residual adds, biases and dropout run. Norms,
dropout and biases are per token, so any split of the tokens works; a contiguous one makes all-gather and
reduce-scatter copy-free. Inside a region (``norm_column``'s output, the heads) activations are
``[B, T, ...]`` of this rank's heads or neurons, as the family's pieces expect.

Dropout is exact against one process with the same seed: each rank draws the mask of the *whole* tensor
from the generator the single process uses (the same seeds, ``models.run.generators``), in the same order,
and keeps its slice: its heads of the attention mask, its tokens of a residual mask. That costs tp times
the random numbers of a shard, and nothing else.

Compiled (``plan.compile``, a ``torch.compile`` backend): the one generic block is compiled per backend,
and dynamo breaks its graph exactly at the collectives, whose entry points are ``torch.compiler.disable``d
(``comms``, ``overlap``): the local compute between them becomes the compiled regions, the communication
stays the eager step's. Per block without overlap the regions are: the first norm | the q/k/v matmul,
attention and the partial output projection | its bias, the residual add and the second norm | the MLP's
matmuls and activation | its bias and residual add (5 graphs, shared by every block: same shapes, no
recompile). With overlap the column/row matmuls are fused with their collectives and stay eager; the
regions around them are alike in number. The breaks are inside the family's pieces, so dynamo's nested
graph breaks must be on (without them a break inside a called function splits every caller's frame too).
Dynamo cannot trace a ``torch.Generator``, and a seed entering the compiled function would recompile it
per block (its value is guarded), so the dropout masks are drawn before the block, eagerly, as the eager
block draws them (``draw``), and enter it as tensors (``Drawn``).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from nanotrain.core.models import run
from nanotrain.core.models.ops import Norm, PlainOps
from nanotrain.tensor_parallel.comms import all_gather_split
from nanotrain.tensor_parallel.layers import column_linear, enter_parallel, leave_parallel, row_linear
from nanotrain.tensor_parallel.shard import TPPlan, token_range
from nanotrain.tensor_parallel.vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_lookup


@dataclass(frozen=True)
class Drawn:
    """A sublayer's dropout masks, this rank's part of each, drawn before a compiled block (None: no dropout)."""
    attention: torch.Tensor | None = None   # of the attention weights
    residual: torch.Tensor | None = None    # of the sublayer's output


class TPOps(PlainOps):
    """The ops on this rank's shard (``shard.shard_params``) of a ``[B, T]`` batch of ``shape``."""

    def __init__(self, plan: TPPlan, shape: tuple[int, int]):
        self.plan, self.shape = plan, (int(shape[0]), int(shape[1]))
        self.group, self.sp, self.overlap = plan.grid.tp_group, plan.sequence_parallel, plan.overlap
        self.tokens = token_range(self.shape[0] * self.shape[1], plan)

    def embed(self, tokens: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor | None = None) -> torch.Tensor:
        """The vocabulary-parallel lookup summed over the ranks (into this rank's tokens), plus their positions."""
        x = leave_parallel(vocab_parallel_lookup(tokens.reshape(-1), wte, self.plan.vocab.start), self.group, self.sp)
        if wpe is None:
            return x
        pos = self.positions(self.shape[1], tokens.device).expand(self.shape).reshape(-1)  # packed rows' are [B, T]
        return x + F.embedding(pos[self.tokens.start:self.tokens.stop], wpe)

    def norm_column(self, x: torch.Tensor, norm: Norm, norm_w: Sequence[torch.Tensor], w: torch.Tensor,
                    b: torch.Tensor | None) -> torch.Tensor:
        """The norm on this rank's tokens, then this rank's outputs of every token, ``[B, T, out / tp]``."""
        return column_linear(norm(x, *norm_w), w, b, self.group, self.sp, self.overlap).view(*self.shape, -1)

    def heads(self, heads: int, kv_heads: int) -> tuple[int, int]:
        return len(self.plan.q_heads), len(self.plan.kv_heads)

    def attention_keep(self, weights: torch.Tensor, p: float, gen: torch.Generator | Drawn) -> torch.Tensor:
        """This rank's heads of the whole mask (drawn already, before a compiled block, as ``Drawn``)."""
        return gen.attention if isinstance(gen, Drawn) else self.attention_mask(gen, p, weights.device)

    def row(self, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """Row-parallel into the flat residual stream; the bias once, after the reduction."""
        return row_linear(y.reshape(-1, y.shape[-1]), w, b, self.group, self.sp, self.overlap)

    def residual_keep(self, x: torch.Tensor, p: float, gen: torch.Generator | Drawn) -> torch.Tensor:
        """This rank's tokens of the whole ``[B, T, C]`` tensor's mask."""
        return gen.residual if isinstance(gen, Drawn) else self.residual_mask(gen, p, x.shape[-1], x.device)

    def head_loss(self, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, denom: float | None,
                  chunk_tokens: int = 2048, keep_logits: bool = False) -> torch.Tensor:
        """The vocabulary-parallel cross-entropy (it computes its gradients in forward: ``keep_logits`` has nothing
        to keep), the same on every rank of the group."""
        h = enter_parallel(h, self.group, self.sp)
        return vocab_parallel_cross_entropy(h, w, targets.reshape(-1), self.plan.vocab.start, self.plan.spec.vocab_size,
                                            self.group, denom, chunk_tokens)

    def logits(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Every token's logits over the real vocabulary ``[tokens, vocab]``, on every rank."""
        h = enter_parallel(h, self.group, self.sp)
        return all_gather_split(F.linear(h, w), self.group, dim=-1)[:, :self.plan.spec.vocab_size]

    # -- dropout masks: this rank's part of the single process's ------------------------------------

    def attention_mask(self, gen: torch.Generator, p: float, device: torch.device) -> torch.Tensor:
        b, t = self.shape
        keep = torch.rand((b, self.plan.spec.heads[0], t, t), generator=gen, device=device, dtype=torch.float32) >= p
        return keep[:, self.plan.q_heads.start:self.plan.q_heads.stop]

    def residual_mask(self, gen: torch.Generator, p: float, width: int, device: torch.device) -> torch.Tensor:
        b, t = self.shape
        keep = torch.rand((b, t, width), generator=gen, device=device, dtype=torch.float32) >= p
        return keep.view(b * t, width)[self.tokens.start:self.tokens.stop]

    def draw(self, seed: int | None, device: torch.device) -> tuple[Drawn | None, Drawn | None]:
        """A block's masks as the eager block draws them: the attention's weights, then its output, from the
        attention's generator; the MLP's output from the MLP's."""
        gen_attn, gen_mlp = run.generators(seed, device)
        if gen_attn is None:
            return None, None
        drop, width = self.plan.spec.dropout, self.plan.spec.costs.width
        attn = self.attention_mask(gen_attn, drop.attention, device) if drop.attention else None

        def residual(gen: torch.Generator) -> torch.Tensor | None:
            return self.residual_mask(gen, drop.residual, width, device) if drop.residual else None
        return Drawn(attn, residual(gen_attn)), Drawn(None, residual(gen_mlp))

    def block_fn(self) -> run.BlockFn | None:
        """What ``run_units`` runs a block with: None (``run.block`` with these ops), or under ``plan.compile``
        the block compiled between the collectives, its masks drawn first."""
        if self.plan.compile is None:
            return None
        spec, fn = self.plan.spec, _compiled(self.plan.compile)

        def step(p: dict, x: torch.Tensor, seed: int | None, index: int, ops: TPOps) -> torch.Tensor:
            return fn(spec, p, x, ops, gens=self.draw(seed, x.device))
        return step

    def forward(self, local: dict, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        """``run_units`` on this rank's shard with these ops; compiled blocks are traced with dynamo's nested graph
        breaks on (see the module docstring), patched once a forward: a patch costs about 0.1 ms."""
        with torch._dynamo.config.patch(nested_graph_breaks=True) if self.plan.compile else nullcontext():
            return run.run_units(self.plan.spec, local, tokens, targets, ops=self, block_fn=self.block_fn(), **kwargs)


@cache
def _compiled(backend: str | Callable) -> Callable:
    """``models.run.block`` compiled once per backend; shapes static: one graph per region, shape and grad mode."""
    return torch.compile(run.block, backend=backend, dynamic=False)


def parallel_hidden_states(local: dict, tokens: torch.Tensor, plan: TPPlan, seed: int | None = None) -> torch.Tensor:
    """embed -> blocks -> final norm on this rank's shard, flat ``[tokens, C]`` (this rank's tokens with SP)."""
    run.validate_tokens(plan.spec, tokens)
    return TPOps(plan, tokens.shape).forward(local, tokens, seed=seed)


def parallel_loss(local: dict, tokens: torch.Tensor, targets: torch.Tensor, plan: TPPlan, seed: int | None = None,
                  denom: int | None = None, chunk_tokens: int = 2048,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy, the same on every rank of the TP group; ``targets`` as in ``models.loss``;
    ``positions``: packed rows' (``models.documents``: every rank builds the whole mask, its heads read it)."""
    run.validate_tokens(plan.spec, tokens)
    if targets.shape != tokens.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} != tokens shape {tuple(tokens.shape)}")
    return TPOps(plan, tokens.shape).forward(local, tokens, targets, seed=seed, denom=denom, chunk_tokens=chunk_tokens,
                                             positions=positions)


def parallel_logits(local: dict, tokens: torch.Tensor, plan: TPPlan) -> torch.Tensor:
    """Full ``[B, T, vocab]`` logits on every rank (inference and tests; training uses ``parallel_loss``)."""
    h = parallel_hidden_states(local, tokens, plan)
    return TPOps(plan, tokens.shape).logits(h, local[plan.spec.head_weight]).reshape(*tokens.shape, -1)
