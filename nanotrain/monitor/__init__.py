"""Where a run's metrics go: one record per step, handed to a list of sinks (stdout, JSONL, ...)."""
from nanotrain.monitor.sinks import JsonlSink, Sink, StdoutSink, cut_jsonl, read_jsonl

__all__ = ["JsonlSink", "Sink", "StdoutSink", "cut_jsonl", "read_jsonl"]
