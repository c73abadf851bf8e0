"""``python -m tasks.bench`` keeps running the streamed fine-tuning benchmark, now ``tasks.bench.stream``."""
from tasks.bench.stream import main

main()
