"""Clipping that keeps the update overlapped with backward: update speculatively, redo a clipped step.

The resident trainer with ``OffloadConfig(exact_skip=True)`` hands each unit to ``OffloadAdam`` the
moment its gradient is final, as without clipping, and sums the units' squared norms on the device.
Every update writes into the optimizer's second copy of masters and moments and the step commits by
swapping the copies, so once the step has closed the copy it swapped out still holds the state from
before it. When the whole norm turns out to be over the threshold (the uncommon case), ``redo``
recomputes every unit's update from that copy with its gradient times the clip factor, over the
speculative result, and sends the weights to the device again; under the threshold nothing more
happens, and the overlap is kept whole.

What it needs: each unit's gradient as it was handed over, still unchanged when the step closes: the
host copy ``OffloadAdam`` made of it (offloaded), or the trainer's gradient buffers (states on the
device). What it costs: the ``exact_skip`` copy (a second copy of masters and moments, 1.7x the update's
memory traffic, see ``OffloadConfig``), and on a clipped step the wait for every update and a second,
un-overlapped update pass. With bf16 gradients on the host the clipped gradient is the bf16 one times
the factor (in fp32), where the after-backward design rounds the clipped fp32 sum to bf16 once.
"""
from __future__ import annotations

import torch

from nanotrain.core.optim.adam import adam_step
from nanotrain.core.optim.offload import OffloadAdam
def redo(opt: OffloadAdam, grads: dict[str, list[torch.Tensor]], factor: torch.Tensor) -> None:
    """Redo the step that just closed with every unit's gradient times ``factor``. ``grads``: the device
    gradients handed over, by unit (read when the states are on the device; offloaded, the host copies are)."""
    opt.synchronize()  # the step's last update is in, and committed
    step = opt.steps  # the redone step keeps its number
    for name, u in opt._units.items():
        old_master, old_state = u.shadow  # the state before the step (swapped out at its commit)
        outs = opt._outputs(u)
        sources = u.grad_host if opt.cfg.offload else grads[name]
        f = factor.to(sources[0].device)
        for i, g in enumerate(sources):
            adam_step(u.master[i], g.float() * f, u.state[i], opt.hp, step, out=outs[i], chunk=opt.cfg.chunk,
                      source=(old_master[i], old_state[i]), scratch=opt._scratch)
        opt._upload(u)
