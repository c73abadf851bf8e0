"""Benchmarks, checks and the peers they race against: ``python -m tasks.bench.<name>``."""
