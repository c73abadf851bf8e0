"""Optimizers: AdamW with 32- or 8-bit moments, offloaded to the CPU and overlapped with backward."""
from nanotrain.core.optim.adam import AdamConfig, init_state
from nanotrain.core.optim.offload import OffloadAdam
from nanotrain.core.optim.units import OffloadConfig
__all__ = ["AdamConfig", "init_state", "OffloadAdam", "OffloadConfig"]
