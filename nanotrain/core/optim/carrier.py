"""What every carrier of AdamW's state offers. The rule is ``adam.adam_step``; a carrier keeps the masters and
moments somewhere, brings them to the update, and the new weights to the compute. Per unit, in every carrier:

- ``weights(at)``: the unit's compute weights, safe to use on the current stream (waiting for any copy or
  update still in flight);
- ``update(at, grads)``: its final gradients, in the order of its paths; AdamW runs now or is queued.

Where every unit's weights stay on the device (``offload.OffloadAdam``, ``data_parallel.DataParallelAdam``;
``data_parallel.ShardedAdam``, a rank's pieces within ZeRO's, by bucket) ``at`` is the unit's name and the
carrier closes the step when the last unit has come; ``clip_norm`` says whether it clips by itself, and
``grad_buffers`` where a trainer may sum gradients. Where units stream through a few device slots
(``stream.optimizer.StreamedAdam``, ``stream.sharded.ShardedStreamedAdam``) ``at`` is the slot, which the trainer fills
(``fetch(unit, slot)``) and frees (``release``), and the trainer closes the step (``finish_step``) once it has
read the loss (``step_loss``) before any update. The carrier follows from where the trainer keeps the
weights, so no trainer asks which it holds.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch


class Carrier(Protocol):
    device: torch.device
    steps: int           # steps applied (the Adam step count); exact after ``synchronize``
    skipped_steps: int   # steps skipped for inf/NaN gradients or loss

    def weights(self, at: Any) -> list[torch.Tensor]: ...

    def update(self, at: Any, grads: list[torch.Tensor]) -> None: ...

    def set_lr(self, lr: float) -> None: ...  # the learning rate of the updates from now on

    def synchronize(self) -> None: ...  # every update queued so far done

    def state_dict(self) -> dict[str, torch.Tensor]: ...  # masters, moments, step counts (``units.state_entries``)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None: ...

    def close(self) -> None: ...


class Wraps:
    """A carrier that moves state for ``inner``, which applies the updates and counts the steps (data
    parallelism's carriers, around the rank's shard)."""

    inner: Carrier
    steps = property(lambda self: self.inner.steps)
    skipped_steps = property(lambda self: self.inner.skipped_steps)

    def set_lr(self, lr: float) -> None:
        self.inner.set_lr(lr)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def close(self) -> None:
        self.inner.close()
