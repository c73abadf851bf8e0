"""Sample text from GPT-2.

    python -m tasks.generate --model gpt2 --prompt "The meaning of life is"
    python -m tasks.generate --model tiny --weights random    # offline, with the tokenizer files found locally

The tokenizer files come from --tokenizer-dir, $NANOTRAIN_TOKENIZER_DIR or ../shared/data/gpt2-tokenizer
when one is there, else from tiktoken's download.
"""
from __future__ import annotations

import argparse

import torch

from nanotrain.cli import add_model_args, fail, model_config, pick_device, tokenizer_dir, warn_nonfinite
from nanotrain.generate import generate
from nanotrain.tokenizer import EOT, TokenizerError, get_tokenizer
from weights import CheckpointError, load_weights


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--prompt", default="", help="text to continue (empty: start from end-of-text)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--num-samples", type=int, default=1)
    args = ap.parse_args(argv)

    cfg = model_config(args.model)
    device = pick_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for flag, value, least in (("--max-new-tokens", args.max_new_tokens, 1), ("--top-k", args.top_k, 1),
                               ("--num-samples", args.num_samples, 1), ("--temperature", args.temperature, 0)):
        if value < least:
            fail(f"{flag} {value} must be at least {least}")
    try:
        tok = get_tokenizer(tokenizer_dir(args.tokenizer_dir))
    except TokenizerError as e:
        fail(str(e))
    ids = tok.encode_ordinary(args.prompt) if args.prompt else [EOT]
    if len(ids) + args.max_new_tokens > cfg.n_ctx:
        room = cfg.n_ctx - len(ids)
        fix = f"use --max-new-tokens {room} or less" if room > 0 else "shorten the prompt"
        fail(f"the prompt's {len(ids)} tokens and --max-new-tokens {args.max_new_tokens} exceed {args.model}'s "
             f"context of {cfg.n_ctx} tokens; {fix}")
    try:
        params = load_weights(args.weights, args.model, cfg, dtype=dtype, device=device, seed=args.seed)
    except (CheckpointError, FileNotFoundError) as e:
        fail(str(e))
    warn_nonfinite(params, args.weights)
    prompt = torch.tensor([ids] * args.num_samples, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    out = generate(params, prompt, cfg, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   generator=gen)
    start = 0 if args.prompt else 1  # without a prompt, drop the end-of-text token it started from
    for i, row in enumerate(out.tolist()):
        print(f"--- sample {i} ---")
        print(tok.decode(row[start:]))


if __name__ == "__main__":
    main()
