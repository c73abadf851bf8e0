"""Token embedding and head cross-entropy with the vocabulary split over ranks.

The loss never gathers logits: each rank computes the logits of its vocabulary rows, and three
per-token numbers are combined across ranks, the max (all-reduce MAX), then the sum of
exponentials and the target's logit (one all-reduce SUM of both, the target's logit being zero
on every rank but its owner). Like ``nanotrain.core.loss``, it works chunk by chunk of tokens and
computes the gradients in forward, so no ``[tokens, vocab/tp]`` tensor outlives its chunk.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanotrain.core.loss import head_grads_, scale_saved_grads, shifted_fp32, target_count
from nanotrain.data.batches import IGNORE_INDEX
from nanotrain.distributed.collectives import Group


def vocab_parallel_lookup(tokens: torch.Tensor, table_shard: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """This rank's share of ``table[tokens]``: the rows it owns, zeros elsewhere; sum over ranks to finish."""
    local = tokens - vocab_start
    mine = (local >= 0) & (local < table_shard.shape[0])
    rows = F.embedding(torch.where(mine, local, 0), table_shard)
    return torch.where(mine[..., None], rows, 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, targets, vocab_start, vocab_size, group, denom, chunk_tokens):  # type: ignore[override]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_local = w.shape[0]
        n_real = min(max(vocab_size - vocab_start, 0), n_local)  # columns past this are padding
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if want_w else None
        for start in range(0, h.shape[0], chunk_tokens):
            hc, tc = h[start:start + chunk_tokens], targets[start:start + chunk_tokens]
            rows = torch.arange(len(tc), device=tc.device)
            valid = tc != IGNORE_INDEX
            local_t = tc - vocab_start
            mine = valid & (local_t >= 0) & (local_t < n_local)
            safe_t = torch.where(mine, local_t, 0)
            logits = hc @ w.t()
            logits[:, n_real:] = float("-inf")
            top = logits.amax(dim=-1).float()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            shifted = shifted_fp32(logits, top)
            picked = torch.where(mine, shifted[rows, safe_t], 0.0)
            sums = torch.stack([shifted.exp_().sum(dim=-1), picked])
            dist.all_reduce(sums, group=group)
            total += torch.where(valid, sums[0].log() - sums[1], 0.0).sum()  # the max cancels
            if want_h or want_w:
                # softmax * valid / denom in one pass; the onehot lives on the target's owner only.
                weight = valid.float() / denom
                head_grads_(shifted.mul_((weight / sums[0])[:, None]), safe_t, torch.where(mine, weight, 0.0), hc, w,
                            grad_h[start:start + chunk_tokens] if want_h else None, grad_w)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = w.dtype
        return total / denom

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        return (*scale_saved_grads(ctx, grad_out), None, None, None, None, None, None)


def vocab_parallel_cross_entropy(h: torch.Tensor, w_shard: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 vocab_size: int, group: Group, denom: int | None = None,
                                 chunk_tokens: int = 2048) -> torch.Tensor:
    """sum over valid tokens of CE(h @ w.T, target) / denom, with the output matrix ``w`` split by vocabulary rows.

    h: ``[N, C]``, the same on every rank, entered through ``copy_all_reduce`` or an all-gather so
    that the partial ``grad_h`` of each rank's vocabulary slice is summed in backward. w_shard:
    rows ``vocab_start:vocab_start + len`` of the padded vocabulary; rows at or past ``vocab_size``
    are padding and excluded. targets: ``[N]`` global ids, -100 to ignore. The returned loss is
    the same on every rank.
    """
    if h.dim() != 2 or targets.shape != h.shape[:1]:
        raise ValueError(f"expected h [N, C] and targets [N], got {tuple(h.shape)} and {tuple(targets.shape)}")
    if denom is None:
        denom = target_count(targets)
    return _VocabParallelCrossEntropy.apply(h, w_shard, targets, vocab_start, vocab_size, group, float(denom),
                                            chunk_tokens)
