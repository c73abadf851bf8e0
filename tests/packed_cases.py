"""Packed batches for the engines' tests, and their reference: every document run on its own.

A batch comes from the library's ``PackedLoader`` over random examples of 2..seq/2+1 ids whose answers start part
way in; the reference splits each row where a position is 0 and runs each piece alone as a ``[1, n]`` batch (its
own causal attention, positions from 0), its loss over the whole batch's target count, and sums: exactly what
the packed batch must compute. Bound (``packed_rtol``): one piece's forward and backward sum the same products as
the packed row's, but the kernels see rows of other lengths (a [1, n] batch against [B, T]: other blockings, other
thread splits), so any reduction of the chain may be summed in another order, not only the attention's over keys
(the packed row's masked keys add exact zeros) and the head's chunking: ``conftest.chain_rtol`` of the model's.
"""
from __future__ import annotations

import torch

from nanotrain.data.batches import IGNORE_INDEX
from nanotrain.core.models import run
from nanotrain.core.models.spec import ModelSpec
from nanotrain.core.tree import Tree, named_leaves
from nanotrain.data.batches import PackedLoader
from nanotrain.data.chat import Example
from tests.conftest import chain_rtol, model_chain


def packed_rtol(model, tokens: torch.Tensor, what: str = "grads") -> float:
    """The module's bound for ``model`` (a config or a spec) on a packed batch ``tokens`` [..., T]: its loss
    (``what="loss"``) or any gradient, norm-wise relative."""
    return chain_rtol(model_chain(getattr(model, "cfg", model), tokens.shape[-1], tokens.numel(), what))


def examples(vocab: int, longest: int, count: int, seed: int = 0) -> list[Example]:
    """``count`` examples of 2..``longest`` ids, each trained from a random point on (its prompt untrained)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for line in range(1, count + 1):
        n = int(torch.randint(2, longest + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (n,), generator=g)
        trained = torch.arange(n) >= int(torch.randint(1, n, (1,), generator=g))  # the prompt is untrained
        out.append(Example(ids, trained, line))
    return out


def packed_batch(vocab: int, rows: int = 4, seq: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(tokens, targets, positions) ``[rows, seq]``, two or three trained documents in most rows."""
    return PackedLoader(examples(vocab, seq // 2 + 1, 6 * rows, seed), seq, rows, pad_id=0, seed=seed).next_batch()


def documents(tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor):
    """Each row's documents as ``[1, n]`` (tokens, targets), padding included (its targets ignored)."""
    for row in range(tokens.shape[0]):
        starts = (positions[row] == 0).nonzero().flatten().tolist() + [tokens.shape[1]]
        for a, b in zip(starts, starts[1:]):
            yield tokens[row:row + 1, a:b], targets[row:row + 1, a:b]


def one_by_one(spec: ModelSpec, params: Tree, tokens: torch.Tensor, targets: torch.Tensor,
               positions: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """The batch's loss and every gradient, each document run alone (fp32 autograd)."""
    leaves = dict(named_leaves(params))
    for t in leaves.values():
        t.requires_grad_().grad = None
    denom = int((targets != IGNORE_INDEX).sum())
    total = sum(run.loss(spec, params, tok, tgt, denom=denom) for tok, tgt in documents(tokens, targets, positions))
    total.backward()
    return float(total.detach()), {path: t.grad.clone() for path, t in leaves.items()}
