"""Peers measured beside nanotrain in the same run (torch DTensor, torch.distributed.pipelining)."""
