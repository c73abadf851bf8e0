"""Optimizers: AdamW with 32- or 8-bit moments, offloaded to the CPU and overlapped with backward."""
from nanotrain.optim.adam import AdamConfig, AdamState8, AdamState32, adam_step, init_state
from nanotrain.optim.offload import OffloadAdam
from nanotrain.optim.units import OffloadConfig
from nanotrain.optim.quant8 import Code, dequantize_blockwise, dynamic_code, quantize_blockwise

__all__ = ["AdamConfig", "AdamState32", "AdamState8", "adam_step", "init_state", "OffloadAdam", "OffloadConfig",
           "Code", "dynamic_code", "quantize_blockwise", "dequantize_blockwise"]
