"""Fine-tuning on one GPU, top to bottom: the file to read first (what ``train.py`` is to nanoGPT).

A run is five steps, each a function below, and each the one ``tasks.finetune`` calls when one process
trains a model whose weights stay on the device:

1. ``resolve_model``: what ``--model`` names (a preset, a Hugging Face folder, a hub id) as a config of its
   family; its ``model_spec`` is what everything downstream reads (units, leaves, costs);
2. ``load``: the model's weights as fp32 masters (or random ones, seeded), a parameter tree (``core.tree``);
3. the data: ``open_data`` (text, instruction JSONL, token files; a text needs the model's ``tokenizer``),
   and a loader of ``[batch, seq]`` token and target batches in a seeded, resumable order;
4. ``build``: the resident trainer (``train.resident``): AdamW's fp32 masters and moments (``optim.offload``:
   in host memory, or on the device), the weights in the compute dtype on the device, micro-batches whose
   gradients add up in fp32, a recompute policy per block, each unit handed to the optimizer the moment its
   gradient is final;
5. ``train``: the one loop (``train.loop``): a step per batch, one metrics record per step to the sinks.

Everything else in the house varies one step of this file: streaming (``stream/``) replaces step 4 when
the model does not fit the device, the parallel engines replace it over many GPUs, and ``run/`` adds the
flags, the memory plan, resuming, checkpoints and the run folder around the five steps.

    python -m nanotrain.core.recipe --model gpt2 --weights random --data ../shared/data/tinyshakespeare.txt \
        --tokenizer-dir ../shared/data/gpt2-tokenizer --seq 128 --steps 10
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanotrain.core.flops import flops_per_token, peak_flops
from nanotrain.core.leaves import tree_of
from nanotrain.core.models import model_spec
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train import loop
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.core.tree import Tree
from nanotrain.data import open_data
from nanotrain.data.token_files import TOKEN_FILES
from nanotrain.monitor import StdoutSink
from nanotrain.tokenizer import Tokenizer, get_tokenizer, load_tokenizer
from weights import ResolvedModel, open_weights, resolve_model

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Recipe:
    """A one-GPU run's settings (``tasks.finetune``'s flags of the same names say more)."""
    model: str = "gpt2"             # a preset, a folder in the Hugging Face layout, or a hub id
    weights: str = "hub"            # "hub" (the model's pretrained ones), "random" (seeded), a checkpoint folder
    data: str = "stdlib"            # text, instruction JSONL, a .bin/.npy token file, or Python's own library
    tokenizer_dir: str | None = None  # a tokenizer.json's folder, or GPT-2's BPE files (default: the model's own)
    seq: int = 256
    batch: int = 8
    micro_batch: int = 8
    steps: int = 20
    lr: float = 1e-4
    weight_decay: float = 0.0
    recompute: str = "none"         # none | every | every-K | selective | lean (``core.recompute``)
    dtype: str = "auto"             # bf16 | fp16 | fp32 | auto: bf16 on a GPU, fp32 on the CPU
    states: str = "cpu"             # where AdamW's masters and moments live: cpu | gpu
    adam_bits: int = 32             # 32, or 8 for block-wise quantized moments
    clip_norm: float | None = None
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.states not in ("cpu", "gpu") or self.dtype not in (*DTYPES, "auto"):
            raise ValueError(f"states {self.states!r} / dtype {self.dtype!r}: states is cpu or gpu, dtype one of "
                             f"{', '.join(DTYPES)} or auto")


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype the model computes in: ``name``'s (bf16, fp16, fp32), or for "auto" bf16 on a GPU, fp32 on the CPU."""
    return DTYPES.get(name, torch.bfloat16 if device.type == "cuda" else torch.float32)


def load(model: ResolvedModel, weights: str, seed: int, dtype: torch.dtype, device: torch.device) -> Tree:
    """Step 2: the fp32 masters to start from, on the host. ``weights``: "hub", "random" or a checkpoint folder or
    file; a random model is made from ``seed`` on ``device`` in the compute ``dtype`` (no file), widened as it loads."""
    with open_weights(model.cfg, model.weights(weights), seed, dtype, device) as leaves:
        return tree_of(model_spec(model.cfg), leaves)


def tokenizer(model: ResolvedModel, folder: str | None, bpe_files: str | None = None) -> Tokenizer:
    """Step 3's tokenizer for text: ``folder``'s when given, else the model's own ``tokenizer.json`` (its folder's,
    a preset's hub repository's), else GPT-2's BPE (from ``bpe_files``, else tiktoken's download)."""
    folder = folder or model.fetch_tokenizer_folder()
    return load_tokenizer(folder) if folder is not None else get_tokenizer(bpe_files)


def offload_config(cfg: Any, device: torch.device, dtype: torch.dtype, states: str, adam_bits: int,
                   **more: Any) -> OffloadConfig:
    """Where AdamW's state lives and what it computes in: masters and moments on the host (``states`` "cpu") or
    the device, ``adam_bits``-bit moments but for the leaves the family keeps in 32 bits (its norms, biases)."""
    return OffloadConfig(device=str(device), dtype=dtype, offload=states == "cpu", state_bits=adam_bits,
                         keep_32bit=model_spec(cfg).fp32_moments, **more)


def build(cfg: Any, params: Tree, tcfg: TrainConfig, adam: AdamConfig, ocfg: OffloadConfig) -> ResidentTrainer:
    """Step 4: the resident trainer. ``params`` become the optimizer's masters (not copied: do not use them after)."""
    return ResidentTrainer(cfg, params, tcfg, adam, ocfg)


def loop_config(cfg: Any, device: torch.device, steps: int, batch: int, seq: int, gpus: int = 1,
                **more: Any) -> loop.LoopConfig:
    """Step 5's settings: the run's total steps, its tokens per step, and what MFU is read against (``gpus``
    GPUs of this one's kind, each working on the step)."""
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return loop.LoopConfig(steps=steps, sequences_per_step=batch, seq_len=seq, flops_per_token=flops_per_token(cfg, seq),
                           peak_flops=peak and peak * gpus, **more)


def train(r: Recipe, sinks: list | None = None) -> list[dict]:
    """The five steps; the loop's records (one per step)."""
    device = torch.device(r.device)
    model = resolve_model(r.model)                                                   # 1. the model
    dtype = compute_dtype(r.dtype, device)
    params = load(model, r.weights, r.seed, dtype, device)                           # 2. its weights
    tok = None if Path(r.data).suffix in TOKEN_FILES else tokenizer(model, r.tokenizer_dir)  # tokens need none
    data = open_data(r.data, tok, model_spec(model.cfg).vocab_size)                  # 3. the data
    loader = data.loader(r.seq, r.batch, seed=r.seed)
    tcfg = TrainConfig(r.batch, r.micro_batch, r.recompute, clip_norm=r.clip_norm)
    adam = AdamConfig(lr=r.lr, weight_decay=r.weight_decay)
    trainer = build(model.cfg, params, tcfg, adam, offload_config(model.cfg, device, dtype, r.states, r.adam_bits))
    del params                                                                       # 4. the trainer owns them
    try:                                                                             # 5. the loop
        return loop.run(trainer, loader.next_batch, loop_config(model.cfg, device, r.steps, r.batch, r.seq),
                        [StdoutSink()] if sinks is None else sinks, device)
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> list[dict]:
    """A flag per field of ``Recipe``, of its type (``str | None``: ``str``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    hints = typing.get_type_hints(Recipe)
    for field in dataclasses.fields(Recipe):
        kind = next((t for t in typing.get_args(hints[field.name]) if t is not type(None)), hints[field.name])
        ap.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=field.default)
    return train(Recipe(**vars(ap.parse_args(argv))))


if __name__ == "__main__":
    main()
