"""Cross-entropy of a linear head, computed chunk by chunk.

At batch 64 x 1024 the fp32 logits of GPT-2 would take 13 GB. Here each chunk of tokens gets
its logits, loss and gradients at once, and only the gradients (the size of the inputs) are kept
for backward: the matmul count is the same as the plain head (logits, grad of hidden, grad of
weight), and no [tokens, vocab] tensor outlives its chunk.

A pipeline's last stage wants the opposite trade: with the gradients computed in forward, its
forward is heavy and its backward light while every other stage runs one forward to two
backwards, and GPipe, interleaved and zero-bubble schedules idle on that mismatch.
``kept_logits_cross_entropy`` keeps the logits (compute dtype) and computes the gradients in
backward instead; under ``nanotrain.core.linear.deferring_weight_grads`` the weight's gradient goes
to the W pass like a linear layer's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanotrain.core.kernels import fused
from nanotrain.core.linear import deferred_to
from nanotrain.data.batches import IGNORE_INDEX  # the data marks the targets that enter no loss


# 50257 columns would make the logits' rows misaligned for the tensor-core GEMMs (cuBLAS then falls
# back to pre-Hopper kernels, a fifth of GPT-2-large's step time on an H200). The head weight is
# padded to this multiple with zero rows whose logits are masked to -inf: same result, fast kernels.
VOCAB_ALIGN = 64


def target_count(targets: torch.Tensor) -> int:
    """The targets a mean loss divides by: those not ``IGNORE_INDEX``, at least 1 (an all-ignored batch's loss
    and gradients are then 0, not NaN)."""
    return max(int((targets != IGNORE_INDEX).sum()), 1)


def validate_targets(targets: torch.Tensor, vocab: int) -> None:
    """Reject target ids outside ``[0, vocab)`` other than ``IGNORE_INDEX``: those in the padded head's
    columns would give a loss of inf without a word, the others an index error deep in a kernel.

    Reads the targets' min and max, so callers check them where they are still on the CPU.
    """
    if not targets.numel():
        return
    counted = targets[targets != IGNORE_INDEX]
    if counted.numel():
        lo, hi = int(counted.min()), int(counted.max())
        if lo < 0 or hi >= vocab:
            bad = hi if hi >= vocab else lo
            raise ValueError(f"target id {bad} is outside the vocabulary [0, {vocab}) (and is not the ignore index "
                             f"{IGNORE_INDEX}); were the targets encoded with another tokenizer?")


def shifted_fp32(logits: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``logits - top`` row-wise, in fp32 whatever the logits' dtype.

    A [n] fp32 ``top`` promotes the difference to fp32, so the upcast of bf16 logits rides in the
    subtraction instead of costing a pass of its own over the [n, V] chunk.
    """
    return logits - top[:, None]


def head_grads_(probs: torch.Tensor, target: torch.Tensor, at_target: torch.Tensor, hc: torch.Tensor,
                w: torch.Tensor, grad_h: torch.Tensor | None, grad_w: torch.Tensor | None) -> torch.Tensor:
    """Gradients of one chunk from ``probs`` [n, V] = softmax times each row's loss weight (overwritten).

    d(loss)/d(logits) = weight * (softmax - onehot); ``at_target`` [n] is the weight to subtract in
    column ``target`` (0 where another shard owns the target). Writes ``grad_h`` (this chunk's
    rows), adds into the fp32 ``grad_w`` and returns d(loss)/d(logits) in ``hc``'s dtype.
    """
    probs[torch.arange(len(target), device=target.device), target] -= at_target
    dlogits = probs.to(hc.dtype)
    if grad_h is not None:
        # Not ``torch.mm(..., out=grad_h)``: out= ops are exempt from autocast, and under bf16 autocast
        # (fp32 hidden states from the final LayerNorm) that ran this GEMM in fp32, 12% of a TP=1 step.
        grad_h.copy_(dlogits @ w)
    if grad_w is not None:
        grad_w += (dlogits.t() @ hc).float()
    return dlogits


def scale_saved_grads(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Backward of a loss whose forward already computed (grad_h, grad_w) for a unit output gradient."""
    grad_h, grad_w = ctx.saved_tensors
    gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
    # In place: the forward's own fp32 sum, read once (a scaled copy beside it is 2 GiB for a 128k vocabulary)
    gw = grad_w.mul_(grad_out).to(ctx.w_dtype) if grad_w is not None else None
    return gh, gw


def softmax_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab: int, scale: torch.Tensor,
                          grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's summed loss over valid rows and, with ``grad``, d(loss * scale)/d(logits) in ``logits``' dtype.

    ``logits`` [n, V'] are against the padded head (columns from ``vocab`` on are masked out);
    ``scale`` is a 0-d tensor (1 / denom), a tensor so a compiled copy does not specialise on it.
    Written as one expression so ``torch.compile`` fuses it into a few passes over the chunk: the
    eager ops each read and wrote the [n, V'] chunk in fp32, a twentieth of a gpt2-large step.
    """
    valid = target != IGNORE_INDEX
    safe = torch.where(valid, target, 0)
    col = torch.arange(logits.shape[1], device=logits.device)
    x = logits.float().masked_fill(col >= vocab, float("-inf"))
    shifted = x - x.amax(dim=-1, keepdim=True)
    exps = shifted.exp()
    sums = exps.sum(dim=-1, keepdim=True)
    picked = shifted.gather(1, safe[:, None])
    loss = torch.where(valid[:, None], sums.log() - picked, 0.0).sum()
    if not grad:
        return loss, None
    weight = (valid.float() * scale)[:, None]
    probs = exps * (weight / sums)
    return loss, torch.where(col == safe[:, None], probs - weight, probs).to(logits.dtype)


def add_into(acc: torch.Tensor, g: torch.Tensor) -> None:
    """``acc += g`` for an fp32 ``acc`` and a low-precision ``g`` (eager: an unvectorised mixed-dtype kernel)."""
    acc.add_(g)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, targets, denom, chunk_tokens):  # type: ignore[override]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        vocab = w.shape[0]
        if vocab % VOCAB_ALIGN:  # F.pad copies even when there is nothing to pad: 1 GiB for a 128k vocabulary
            w = F.pad(w, (0, 0, 0, -vocab % VOCAB_ALIGN))
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        scale = torch.full((), 1.0 / denom, dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if want_w else None
        xent, add = fused(softmax_cross_entropy, h.device), fused(add_into, h.device)
        for start in range(0, h.shape[0], chunk_tokens):
            hc = h[start:start + chunk_tokens]
            loss, dlogits = xent(hc @ w.t(), targets[start:start + chunk_tokens], vocab, scale, want_h or want_w)
            total += loss
            if want_h:  # not ``torch.mm(..., out=grad_h)``: see ``head_grads_``
                grad_h[start:start + chunk_tokens].copy_(dlogits @ w)
            if want_w:
                add(grad_w, dlogits.t() @ hc)
        ctx.save_for_backward(grad_h, grad_w[:vocab] if want_w else None)
        ctx.w_dtype = w.dtype
        return total / denom

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        return (*scale_saved_grads(ctx, grad_out), None, None, None)


def chunked_cross_entropy(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, denom: int | None = None,
                          chunk_tokens: int = 2048) -> torch.Tensor:
    """sum over valid tokens of CE(h @ w.T, target) / denom.

    h: [N, C] hidden states, w: [V, C] head weight, targets: [N] with -100 for ignored positions.
    ``denom`` defaults to the number of valid targets here; a trainer that accumulates micro-batches
    passes the whole batch's count so the micro-batch losses add up to the batch mean. With no
    valid target and no ``denom`` the loss is 0 (not NaN) and so are the gradients.
    """
    if h.dim() != 2 or targets.shape != h.shape[:1]:
        raise ValueError(f"expected h [N, C] and targets [N], got {tuple(h.shape)} and {tuple(targets.shape)}")
    if denom is None:  # reads the targets anyway: check them too
        validate_targets(targets, w.shape[0])
        denom = target_count(targets)
    return _ChunkedLinearCrossEntropy.apply(h, w, targets, float(denom), chunk_tokens)


class _KeptLogitsCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, targets, denom, chunk_tokens):  # type: ignore[override]
        vocab = w.shape[0]
        wp = F.pad(w, (0, 0, 0, -vocab % VOCAB_ALIGN))
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        kept = []
        for start in range(0, h.shape[0], chunk_tokens):
            tc = targets[start:start + chunk_tokens]
            valid = tc != IGNORE_INDEX
            logits = h[start:start + chunk_tokens] @ wp.t()
            logits[:, vocab:] = float("-inf")  # the padding columns
            top = logits.amax(dim=-1).float()
            shifted = shifted_fp32(logits, top)
            picked = shifted.gather(1, torch.where(valid, tc, 0)[:, None]).squeeze(1)
            log_sums = shifted.exp_().sum(dim=-1).log()
            total += torch.where(valid, log_sums - picked, 0.0).sum()
            kept += [logits, top + log_sums]
        ctx.save_for_backward(h, w, targets, *kept)
        ctx.denom, ctx.chunk_tokens, ctx.pending = denom, chunk_tokens, deferred_to()
        return total / denom

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        h, w, targets, *kept = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        vocab = w.shape[0]
        wp = F.pad(w, (0, 0, 0, -vocab % VOCAB_ALIGN))
        grad_h = torch.empty_like(h) if want_h else None
        defer = want_w and ctx.pending is not None
        grad_w = torch.zeros(wp.shape, dtype=torch.float32, device=w.device) if want_w and not defer else None
        for i, start in enumerate(range(0, h.shape[0], ctx.chunk_tokens)):
            hc, tc = h[start:start + ctx.chunk_tokens], targets[start:start + ctx.chunk_tokens]
            logits, lse = kept[2 * i], kept[2 * i + 1]
            valid = tc != IGNORE_INDEX
            weight = valid.float() * (grad_out.float() / ctx.denom)
            probs = shifted_fp32(logits, lse).exp_().mul_(weight[:, None])
            dlogits = head_grads_(probs, torch.where(valid, tc, 0), weight, hc, wp,
                                  grad_h[start:start + len(tc)] if want_h else None, grad_w)
            if defer:
                ctx.pending.append((w, hc, dlogits[:, :vocab]))
        gw = grad_w[:vocab].to(w.dtype) if grad_w is not None else None
        return grad_h, gw, None, None, None


def kept_logits_cross_entropy(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, denom: float,
                              chunk_tokens: int = 2048) -> torch.Tensor:
    """``chunked_cross_entropy`` with the gradients computed in backward from logits kept since forward.

    Costs the [N, vocab] logits in the compute dtype between forward and backward; the matmuls
    are the same three.
    """
    if h.dim() != 2 or targets.shape != h.shape[:1]:
        raise ValueError(f"expected h [N, C] and targets [N], got {tuple(h.shape)} and {tuple(targets.shape)}")
    return _KeptLogitsCrossEntropy.apply(h, w, targets, float(denom), chunk_tokens)
