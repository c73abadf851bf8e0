"""Peers measured beside nanotrain in the same run (transformers, torch DTensor, torch.distributed.pipelining,
CPU-offload trainers)."""
