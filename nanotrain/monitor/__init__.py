"""Where a run's metrics go: one record per step, handed to sinks (stdout, JSONL, TensorBoard; every rank's
gathered on the first), the NVML sampler that adds GPU readings, and the step profiler."""
from nanotrain.monitor.nvml import NvmlSampler
from nanotrain.monitor.ranks import GatherRanks
from nanotrain.monitor.sinks import JsonlSink, StdoutSink, cut_jsonl, read_jsonl
from nanotrain.monitor.tensorboard import TensorBoardSink, tensorboard_available

__all__ = ["GatherRanks", "JsonlSink", "NvmlSampler", "StdoutSink", "TensorBoardSink", "cut_jsonl",
           "read_jsonl", "tensorboard_available"]
