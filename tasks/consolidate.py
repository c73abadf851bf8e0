"""The old name of ``tasks.export``: a checkpoint (any format) as a folder that serves.

    python -m tasks.consolidate runs/finetune/step-000030 --out runs/finetune/hf
"""
from tasks.export import main

if __name__ == "__main__":
    main()
