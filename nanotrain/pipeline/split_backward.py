"""Backward split into an input-gradient pass (I) and a weight-gradient pass (W), exactly.

Under ``deferring_weight_grads(pending)`` every ``nanotrain.linear.linear`` whose weight needs a
gradient computes in backward the gradients of its input and bias only, and appends
(weight, input, grad_output) to ``pending``. A normal ``torch.autograd.backward`` is then the I
pass: it walks the whole graph, produces the stage input's gradient (to send upstream at once)
and the cheap gradients (norms, biases, embeddings), and frees the graph. ``apply_weight_grads``
is the W pass: grad_weight = grad_output^T @ input per linear, the matmul autograd would have
run, just later. The alternative of two ``autograd.grad`` calls (inputs, then params) would
walk the graph twice and redo the input-gradient matmuls in W. Weights used other than through
``linear`` (convolutions, the tied LM head) get their gradient in I, which is still exact.
"""
from __future__ import annotations

import torch

from nanotrain.linear import Pending


def apply_weight_grads(pending: Pending) -> None:
    """The W pass: accumulate every deferred weight gradient (through any cast or view of the weight)."""
    if not pending:
        return
    weights = [w for w, _, _ in pending]
    grads = [g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) for _, x, g in pending]
    pending.clear()
    torch.autograd.backward(weights, grads)
