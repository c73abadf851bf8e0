"""Fine-tune any model (GPT-2, Llama 3.x, Qwen 2.5/3, Mistral) with AdamW under a GPU memory cap: the flagship job.

    python -m tasks.finetune --model gpt2-large --gpu-mem-gib 11 --batch 64 --seq 1024 --steps 30 --data stdlib
    python -m tasks.finetune --help     # every option, what a run writes, how it resumes

The run itself is the library's (``nanotrain.run``: flags, plans, inputs, the run folder, the loop's wiring).
"""
from __future__ import annotations

from nanotrain.run.finetune import main

if __name__ == "__main__":
    main()
