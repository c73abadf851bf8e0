"""A checkpoint as a folder that serves: ``config.json``, ``generation_config.json``, the weights as bf16 (or
fp16, fp32) safetensors, sharded with an index past ``max_shard_bytes``, and the model's tokenizer files and chat
template; ``transformers``' ``AutoModelForCausalLM`` and ``AutoTokenizer``, ``tasks.generate --model OUT``,
``--weights OUT`` and inference servers load it.

Any checkpoint exports (one process, sharded, 3D): its fp32 masters are read a leaf at a time
(``resume.saved_masters``, the one reader that knows the formats: a sharded leaf's slices assembled for it
alone), each checked against the dtype's range, rounded to it and written before the next is read, into shards
written as they fill. An export holds one leaf in fp32 and one of its file tensors, whatever the model: for
``llama-3.1-8b`` its 2.1 GB embedding, not 32 GB of masters. The checkpoint's files are checked against its
``SHA256SUMS`` before anything is written. A LoRA run's checkpoint exports its pairs as a PEFT adapter folder
(``weights.peft``), which ``peft`` loads on the run's base model. The folder is written under a temporary name
beside ``out`` and renamed into place, so ``out`` holds a whole export (a re-export replaces one, and only a
folder that holds nothing but an export's files).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from fnmatch import fnmatch
from math import prod
from pathlib import Path
from typing import Any, Callable

import torch

from nanotrain.checkpoint.resume import load_masters, saved_masters
from nanotrain.checkpoint.checksums import verify
from nanotrain.checkpoint.disk import check_space
from nanotrain.checkpoint.run_dir import named_by_latest
from nanotrain.checkpoint.slices import is_checkpoint
from nanotrain.core.leaves import Leaves
from nanotrain.core.models import model_spec
from nanotrain.core.models.run import tree_from
from weights import CheckpointError, hf_config, read_config, write_generation_config, write_tokenizer
from weights.files import DEFAULT_SHARD_BYTES
from weights.peft import CONFIG as ADAPTER_CONFIG, WEIGHTS as ADAPTER_WEIGHTS, adapted_spec, save_adapter
from weights.save import save_leaves
from weights.table import describe
from weights.tokenizer_files import TOKENIZER_FILES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# What an export writes: a folder holding nothing else may be replaced by the next export.
EXPORT_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors",
                ADAPTER_CONFIG, ADAPTER_WEIGHTS, *TOKENIZER_FILES)


@dataclass(frozen=True)
class ExportConfig:
    dtype: torch.dtype = torch.bfloat16
    max_shard_bytes: int = DEFAULT_SHARD_BYTES  # transformers' "5GB": shards and an index past it


def checkpoint_in(path: str | Path) -> Path:
    """``path`` itself when it is a checkpoint (``step-N``), else the checkpoint the run folder's ``latest``
    names."""
    path = Path(path)
    # trainer.json: every checkpoint this format wrote; layout.json: an old 3D one (tasks/old_checkpoints.py)
    if (path / "trainer.json").is_file() or is_checkpoint(path) or (path / "layout.json").is_file():
        return path
    named = named_by_latest(path)
    if named is None:
        raise CheckpointError(f"{path} is neither a checkpoint (it has no trainer.json) nor a run folder (it has no "
                              f"'latest'): pass a run's --out or one of its step-N folders")
    return named


def read_masters(ckpt: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's fp32 masters by tree path, whole, whichever format saved them."""
    return load_masters(ckpt)


def export_checkpoint(ckpt: str | Path, out: str | Path, cfg: Any = None, tokenizer: Path | None = None,
                      ecfg: ExportConfig = ExportConfig()) -> list[Path]:
    """Export ``ckpt`` (a checkpoint or a run folder: its latest) as a folder that serves in ``out``: the model
    ``cfg`` (None: the checkpoint's ``config.json``), the tokenizer in the folder ``tokenizer`` (a
    ``tokenizer.json`` and what comes with it, or GPT-2's BPE files; None: no tokenizer files). Raises
    ``CheckpointError`` (one line) for a damaged checkpoint or an ``out`` it may not replace, leaving ``out`` as it
    was. Returns the files written."""
    ckpt = checkpoint_in(ckpt)
    verify(ckpt)  # nothing is exported from files that changed since the save
    if (ckpt / ADAPTER_CONFIG).is_file():
        return export_adapter(ckpt, out, cfg, tokenizer)
    with saved_masters(ckpt) as masters:
        return export_leaves(masters, cfg or read_config(ckpt), out, tokenizer, ecfg)


def export_adapter(ckpt: Path, out: str | Path, cfg: Any = None, tokenizer: Path | None = None) -> list[Path]:
    """A LoRA checkpoint's pairs (fp32, as PEFT saves them) as a PEFT adapter folder in ``out``, with the tokenizer;
    the base is the run's ``--weights``, which ``PeftModel.from_pretrained`` loads it on. The pairs are read whole:
    they are the model's few parts in a thousand at the ranks LoRA runs at."""
    spec, out = adapted_spec(ckpt, cfg or read_config(ckpt)), Path(out)
    masters = read_masters(ckpt)
    _check_replaceable(out)
    check_space(out.parent, out.name, sum(t.numel() * 4 for t in masters.values()))
    pairs = tree_from(spec, masters.items())

    def write(tmp: Path) -> None:
        save_adapter(tmp, spec, pairs)
        if tokenizer is not None:
            write_tokenizer(tokenizer, tmp, spec.n_ctx)

    return _written(out, write)


def export_masters(masters: dict[str, torch.Tensor], cfg: Any, out: str | Path, tokenizer: Path | None = None,
                   ecfg: ExportConfig = ExportConfig()) -> list[Path]:
    """``masters`` held (fp32, by tree path: an old format's) of the model ``cfg`` exported to ``out`` as
    ``export_checkpoint`` does."""
    return export_leaves(Leaves({path: tuple(t.shape) for path, t in masters.items()}, masters.__getitem__), cfg,
                         out, tokenizer, ecfg)


def export_leaves(masters: Leaves, cfg: Any, out: str | Path, tokenizer: Path | None = None,
                  ecfg: ExportConfig = ExportConfig()) -> list[Path]:
    """``masters`` of the model ``cfg``, read a leaf at a time in the order of its leaves, each rounded to
    ``ecfg.dtype`` and written to ``out`` before the next is read. A value beyond the dtype's range is refused when
    its leaf is read: the folder being written is removed, ``out`` is left as it was."""
    spec, out = model_spec(cfg), Path(out)
    if masters.shapes != {path: tuple(shape) for path, shape in spec.shapes.items()}:
        raise CheckpointError(f"the checkpoint's weights are not those of a {describe(spec)} ({cfg}); export it as "
                              f"the model it trained (leave --model out, or pass that one)")
    _check_replaceable(out)
    itemsize = torch.empty((), dtype=ecfg.dtype).element_size()
    check_space(out.parent, out.name, sum(prod(shape) for shape in masters.shapes.values()) * itemsize)

    def write(tmp: Path) -> None:
        save_leaves(tmp, cfg, (_in_range(leaf.path, masters.read(leaf.path), ecfg.dtype) for leaf in spec.leaves),
                    ecfg.dtype, ecfg.max_shard_bytes)
        if tokenizer is not None:
            write_tokenizer(tokenizer, tmp, spec.n_ctx)
        write_generation_config(tmp, hf_config(cfg))

    return _written(out, write)


def _written(out: Path, write: Callable[[Path], None]) -> list[Path]:
    """``write`` into a temporary folder beside ``out`` (checked replaceable), then renamed into place."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    for kind in ("tmp", "old"):  # what a killed export left
        for left in out.parent.glob(f".{out.name}.{kind}-*"):
            shutil.rmtree(left, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(out.iterdir())


def _in_range(path: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t``, refused when a finite value of it exceeds ``dtype``'s range (fp16's 65504): rounding would make it
    infinite."""
    top = torch.finfo(dtype).max
    if t.numel() == 0 or bool((torch.stack(torch.aminmax(t)).abs() <= top).all()):
        return t  # within range, no inf or NaN (they compare False): known without a copy of the leaf
    finite = t[t.isfinite()]
    big = finite.abs().max().item() if finite.numel() else 0.0
    if big > top:
        raise CheckpointError(f"{path} holds {big:.4g}, beyond {str(dtype).removeprefix('torch.')}'s largest "
                              f"value {top:.4g}: export in bf16 or fp32")
    return t


def _check_replaceable(out: Path) -> None:
    """Refuse an ``out`` that is a file, or a folder holding anything an export does not write (a run folder, a
    checkpoint, the model's own folder): replacing it would delete them."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file; pass a folder (it is created, or replaced if it holds an "
                              f"export)")
    others = sorted(p.name for p in out.iterdir() if not any(fnmatch(p.name, f) for f in EXPORT_FILES)) \
        if out.is_dir() else []
    if others:
        raise CheckpointError(f"--out {out} holds files an export does not write ({', '.join(others[:3])}"
                              f"{', ...' if len(others) > 3 else ''}); pass a new or empty folder")


def _replace(tmp: Path, out: Path) -> None:
    """``tmp`` renamed to ``out``, the export that was there moved aside first and removed after."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
