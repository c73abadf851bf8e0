"""Sample text from a model, with its own tokenizer.

    python -m tasks.generate --model gpt2 --prompt "The meaning of life is"
    python -m tasks.generate --model meta-llama/Llama-3.2-1B --prompt "The meaning of life is"
    python -m tasks.generate --model /path/to/hf-folder     # config.json, safetensors, tokenizer.json
    python -m tasks.generate --model tiny --weights random  # offline, with the tokenizer files found locally
    python -m tasks.generate --model tiny --weights runs/finetune/step-000200  # a run's checkpoint

A folder or hub id brings its tokenizer.json; a preset uses GPT-2's BPE, whose files come from
--tokenizer-dir, $NANOTRAIN_TOKENIZER_DIR or ../shared/data/gpt2-tokenizer when one is there, else from
tiktoken's download.
"""
from __future__ import annotations

import argparse

import torch

from nanotrain.checkpoint.resume import load_masters
from nanotrain.checkpoint.slices import is_checkpoint
from nanotrain.run.cli import add_model_args, fail, model_tokenizer, pick_device, resolve, warn_nonfinite
from nanotrain.core.generate import generate
from nanotrain.core.models import model_spec
from nanotrain.core.models.run import tree_from
from nanotrain.core.leaves import nonfinite
from nanotrain.core.tree import named_leaves, tree_map
from weights import CheckpointError, load_weights


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--prompt", default="", help="text to continue (empty: start from the BOS or EOS token)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--num-samples", type=int, default=1)
    args = ap.parse_args(argv)

    for flag, value, least in (("--max-new-tokens", args.max_new_tokens, 1), ("--top-k", args.top_k, 1),
                               ("--num-samples", args.num_samples, 1), ("--temperature", args.temperature, 0)):
        if value < least:
            fail(f"{flag} {value} must be at least {least}")
    model = resolve(args.model)
    spec = model_spec(model.cfg)
    n_ctx = spec.n_ctx
    device = pick_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok = model_tokenizer(model, args.tokenizer_dir)
    start = tok.bos_id if tok.bos_id is not None else tok.eos_id
    ids = tok.encode(args.prompt) or ([start] if start is not None else [])
    if not ids:
        fail("the tokenizer has neither a BOS nor an EOS token to start from: give a --prompt")
    if len(ids) + args.max_new_tokens > n_ctx:
        room = n_ctx - len(ids)
        fix = f"use --max-new-tokens {room} or less" if room > 0 else "shorten the prompt"
        fail(f"the prompt's {len(ids)} tokens and --max-new-tokens {args.max_new_tokens} exceed {args.model}'s "
             f"{spec.longest}; {fix}")
    try:
        source = model.weights(args.weights)
        if is_checkpoint(source):  # a run's checkpoint holds no model file: its fp32 masters are the weights
            params = tree_map(lambda t: t.to(device, dtype), tree_from(model_spec(model.cfg),
                                                                      load_masters(source).items()))
        else:
            params = load_weights(model.cfg, source, dtype=dtype, device=device, seed=args.seed)
    except (CheckpointError, FileNotFoundError) as e:
        fail(str(e))
    warn_nonfinite(nonfinite(named_leaves(params)), args.weights)
    prompt = torch.tensor([ids] * args.num_samples, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    out = generate(params, prompt, model.cfg, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   generator=gen)
    # Print from the prompt's text on: without a prompt, drop the token it started from; with one, the BOS
    # the tokenizer added before it.
    added_bos = ids[0] == tok.bos_id and len(ids) > len(tok.encode_ordinary(args.prompt))
    skip = int(added_bos) if args.prompt else len(ids)
    for i, row in enumerate(out.tolist()):
        print(f"--- sample {i} ---")
        print(tok.decode(row[skip:]))


if __name__ == "__main__":
    main()
