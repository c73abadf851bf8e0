"""``DPConfig``: how the data-parallel engine shards and reduces (the ZeRO stage, buckets, reduce dtype); and how a
global batch splits over the ranks (``check_split``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DPConfig:
    zero: int = 0                                # 0 (DDP), 1, 2 or 3 (zero3.py)
    bucket_mb: float = 25.0                      # fp32 gradient megabytes per bucket (0: one unit each)
    reduce_dtype: torch.dtype = torch.float32    # what the gradients travel and are summed in
    check_replicas: bool = False                 # after every step, check all ranks hold equal weights
    # ZeRO-3: each unit gathered once a step and held to its end (one all-gather a step, not two a micro-batch; the
    # whole model's weights held, as ZeRO-1/2 hold them); its gradients still reduce-scattered every micro-batch
    hold: bool = False

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero stage {self.zero} is not one of 0 (DDP), 1, 2 or 3")
        if self.zero == 3 and self.check_replicas:
            raise ValueError("ZeRO-3 keeps no replicated weights to check; check replicas with zero stage 0, 1 or 2")
        if self.hold and self.zero != 3:
            raise ValueError(f"holding gathered weights is ZeRO-3's (zero stage {self.zero} keeps them whole): use "
                             f"zero stage 3 with it, or leave it out")
        if self.bucket_mb < 0:
            raise ValueError(f"bucket size {self.bucket_mb} MB must be >= 0")
        if self.reduce_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"reduce dtype {self.reduce_dtype} must be torch.float32 or torch.bfloat16")


def stage_name(zero: int, hold: bool = False) -> str:
    """A data-parallel stage in words: DDP or ZeRO-N, and ZeRO-3 holding its weights (``DPConfig.hold``)."""
    return (f"ZeRO-{zero}" if zero else "DDP") + (", weights held through the step" if hold else "")


def check_split(batch: int, micro_batch: int, world: int) -> None:
    """A global batch must split into ``world`` equal slices of whole micro-batches."""
    unit = world * micro_batch
    if batch % unit:
        fits = [m for m in range(1, batch // world + 1) if batch % (world * m) == 0]
        other = f" or a micro-batch of {', '.join(map(str, fits))}" if fits else ""
        raise ValueError(f"batch {batch} does not split over {world} data-parallel ranks in micro-batches of "
                         f"{micro_batch}: it must be a multiple of {world} x {micro_batch} = {unit}; use a batch of "
                         f"{-(-batch // unit) * unit}{other}")
