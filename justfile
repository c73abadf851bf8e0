# nanotrain recipes: `just --list` shows them all.

tokdir := if path_exists("../shared/data/gpt2-tokenizer") == "true" { "--tokenizer-dir ../shared/data/gpt2-tokenizer" } else { "" }

# Run the CPU test suite (what CI runs).
test *args:
    python -m pytest -q {{args}}

# Sample from GPT-2 (e.g. `just generate gpt2 "Once upon a time"`; --weights random works offline).
generate model="gpt2" prompt="The meaning of life is" *args="":
    python -m tasks.generate --model {{model}} --prompt "{{prompt}}" {{tokdir}} {{args}}

# Plain forward+backward speed of our GPT-2 vs HF transformers (needs a CUDA GPU).
bench-model *args="":
    python -m tasks.bench_model {{args}}
