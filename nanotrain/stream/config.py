"""The streamed trainer's settings (``stream.trainer``) and their check against the model."""
from __future__ import annotations

from dataclasses import dataclass

from nanotrain.core.models.spec import ModelSpec
from nanotrain.core.train.step import StepConfig


@dataclass(frozen=True)
class StreamConfig(StepConfig):
    """The streamed trainer's step: ``StepConfig``'s (compiling the block's forward and its recompute + backward;
    clipping exact, its updates deferred: ``stream.deferred``), and where the block inputs and the tail go."""
    on_host: int = 0               # how many block inputs (from the first) are kept in host memory
    tail: int = 0                  # top blocks run micro-batch by micro-batch with the head: no recompute
    tail_micro_batch: int | None = None  # sequences per pass through the tail (default: micro_batch)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tail < 0:
            raise ValueError(f"tail={self.tail} must be >= 0")
        t = self.tail_micro_batch
        if t is not None and (t < 1 or self.micro_batch % t):
            raise ValueError(f"tail micro-batch {t} must divide the micro-batch {self.micro_batch}")
        if self.on_host < 0:
            raise ValueError(f"on_host={self.on_host} must be >= 0")

    def check(self, spec: ModelSpec) -> None:
        """That these settings fit the model."""
        n = spec.n_layer
        if self.tail > n:
            raise ValueError(f"tail={self.tail}: the model has only {n} blocks")
        if self.on_host > n - self.tail:
            raise ValueError(f"on_host={self.on_host}: the model keeps only {n - self.tail} block inputs "
                             f"({n} blocks, {self.tail} of them in the tail)")
        if spec.dropout.any and (self.tail_micro_batch or self.micro_batch) != self.micro_batch:
            raise ValueError("with dropout the tail runs whole micro-batches (a dropout mask is drawn per "
                             "micro-batch): leave tail_micro_batch unset")
