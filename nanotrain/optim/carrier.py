"""What every carrier of AdamW's state offers: the rule is ``adam.adam_step``; a carrier keeps the masters and
moments somewhere, brings them to the update, and the new weights to the compute.

Per unit of the model's spec, two calls, the same in every carrier:

- ``weights(at)``: the unit's compute weights, safe to use on the current stream (waiting for any copy or
  update still in flight);
- ``update(at, grads)``: its final gradients, in the order of its paths; AdamW runs now or is queued.

``at`` names where the unit is. Where every unit's weights stay on the device (``offload.OffloadAdam``,
``data_parallel.DataParallelAdam``) it is the unit's name (``data_parallel.ShardedAdam``, a rank's pieces
inside ZeRO's, takes the bucket), and the carrier closes the step when the last
unit has come; ``clip_norm`` says whether it clips by itself, and ``grad_buffers`` where a trainer may sum
gradients. Where units stream through a few device slots (``streamed.StreamedAdam``,
``data_parallel.ShardedStreamedAdam``) it is the slot, which the trainer fills with ``load(unit, slot)``
and frees with ``release(slot)``, and the trainer closes the step (``finish_step``), having read the loss
(``step_loss``) before any update. Which one a trainer holds follows from where it keeps the weights, so no
trainer asks; ``Carrier`` is the part both kinds of trainer and checkpoints use alike.
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
