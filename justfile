# nanotrain recipes: `just --list` shows them all.

tokdir := if path_exists("../shared/data/gpt2-tokenizer") == "true" { "--tokenizer-dir ../shared/data/gpt2-tokenizer" } else { "" }

# Run the CPU test suite (what CI runs).
test *args:
    python -m pytest -q {{args}}

# The CPU suite under other kernels and thread counts, as CI hosts differ: 1 and 2 threads, each with the CPU's
# own instruction set (AVX-512 where it has it) and with oneDNN and MKL held to AVX2 (ATen's own kernels are left
# alone: with ATEN_CPU_CAPABILITY=avx2 on an AVX-512 host, torch 2.13, a compiled block computes NaN in
# tests/core/test_packing.py -k compiled, and the eager ones pass). A bound derived from
# the computation it checks (tests/conftest.py: chain_rtol, adam_apart) holds under all four. Cost:
# four runs of `just test` (the 3D files alone, `just test-isa tests/compose`, 4 x ~1.5 min on two idle cores).
test-isa *args="tests":
    for threads in 1 2; do \
        echo "== $threads thread(s), the CPU's own instruction set"; \
        OMP_NUM_THREADS=$threads python -m pytest -q {{args}} || exit 1; \
        echo "== $threads thread(s), AVX2"; \
        OMP_NUM_THREADS=$threads ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
            python -m pytest -q {{args}} || exit 1; \
    done

# Sample from GPT-2 (e.g. `just generate gpt2 "Once upon a time"`; --weights random works offline).
generate model="gpt2" prompt="The meaning of life is" *args="":
    python -m tasks.generate --model {{model}} --prompt "{{prompt}}" {{tokdir}} {{args}}

# Plain forward+backward speed of our GPT-2 vs HF transformers (needs a CUDA GPU).
bench-model *args="":
    python -m tasks.bench.model {{args}}

# Capped and streamed fine-tuning beside our plain run, HF and FSDP2 CPU offload (needs a CUDA GPU).
bench *args="":
    python -m tasks.bench {{args}}

# Fine-tune gpt2-large in 11 GiB on a GPU, weights streamed (the fastest under a cap); tiny on a CPU; 5 warm-up steps.
finetune *args="":
    if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
        python -m tasks.finetune --model gpt2-large --gpu-mem-gib 11 --host-mem-gib 16 --stream --compile --batch 64 --seq 1024 --steps 30 --lr-schedule cosine --warmup-steps 5 --data stdlib {{tokdir}} {{args}}; \
    else \
        python -m tasks.finetune --model tiny --batch 16 --seq 128 --micro-batch 4 --recompute every --steps 30 --lr 1e-3 --lr-schedule cosine --warmup-steps 5 --data stdlib {{tokdir}} {{args}}; \
    fi

# Live dashboard of a run's metrics (TensorBoard) on http://localhost:6006, e.g. `just dashboard runs/finetune`.
dashboard run_dir="runs" port="6006":
    python -m tensorboard.main --logdir {{run_dir}} --host localhost --port {{port}}

# gpt2-xl in 11 GiB of GPU memory and 16 GiB of RAM: streamed weights, 8-bit moments (tiny, streamed, on a CPU).
# Eager: its streamed blocks measured faster eager than compiled (docs/BENCHMARKS.md), and a first compile's host
# memory would not fit 16 GiB (the plan refuses it, naming 19.4).
finetune-xl *args="":
    if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
        python -m tasks.finetune --model gpt2-xl --gpu-mem-gib 11 --host-mem-gib 16 --stream --no-compile --adam-bits 8 --batch 64 --seq 1024 --steps 30 --data stdlib --out runs/finetune-xl {{tokdir}} {{args}}; \
    else \
        python -m tasks.finetune --model tiny --stream --adam-bits 8 --batch 16 --seq 128 --micro-batch 4 --steps 30 --lr 1e-3 --data stdlib --out runs/finetune-xl {{tokdir}} {{args}}; \
    fi

# 8-bit against 32-bit Adam moments on the same batches: both loss curves in runs/adam_bits/.
compare-adam-bits *args="":
    python -m tasks.compare_adam_bits {{ if path_exists("../shared/data/tinyshakespeare.txt") == "true" { "--data ../shared/data/tinyshakespeare.txt" } else { "" } }} {{tokdir}} {{args}}

# Pipeline-parallel training against one process (CPU processes by default; see tasks/pipeline.py).
pipeline *args="":
    python -m tasks.pipeline {{args}}

# Tensor-parallel training against one process (see tasks/tensor_parallel.py).
tensor-parallel *args="":
    python -m tasks.tensor_parallel {{args}}
