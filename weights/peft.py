"""Adapters in PEFT's layout: a folder with ``adapter_config.json`` and ``adapter_model.safetensors`` under PEFT's
key names, which ``peft.PeftModel.from_pretrained`` loads on ``transformers``' model of the base.

A pair's module is the Hugging Face tensor its target's rows are (``HFLayout.block``: Llama's ``q`` is the first
tensor of the fused ``qkv_w``, ``self_attn.q_proj``); PEFT's A and B are ``[r, in]`` and ``[out, r]`` as ours,
also on GPT-2's ``Conv1D`` (only its merge transposes: ``fan_in_fan_out``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from nanotrain.core.models import family_of, model_spec, run
from nanotrain.core.models.lora import Adapter, LoraConfig, merge, rank, with_lora
from nanotrain.core.models.spec import ModelSpec
from nanotrain.core.tree import Tree, get_path

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def module(spec: ModelSpec, ad: Adapter) -> str:
    """The target's module within a layer (``self_attn.q_proj``, GPT-2's ``mlp.c_proj``)."""
    return family_of(spec.cfg).hf.block[ad.weight][ad.segment or 0].removesuffix(".weight")


def peft_keys(spec: ModelSpec) -> dict[str, str]:
    """Our adapter leaf path -> its key in ``adapter_model.safetensors`` (a live ``PeftModel``'s parameter names
    add the adapter's name, ``.default``, before ``.weight``)."""
    prefix = family_of(spec.cfg).hf.layer_prefix
    return {f"blocks.{u.index}.{leaf}": f"base_model.model.{prefix}{u.index}.{module(spec, ad)}.lora_{ab}.weight"
            for u in spec.block_units for ad in spec.adapters for leaf, ab in ((ad.a, "A"), (ad.b, "B"))}


def adapter_config(spec: ModelSpec, base_model: str = "") -> dict:
    """The ``adapter_config.json`` PEFT reads for ``spec``'s pairs."""
    hf = family_of(spec.cfg).hf
    r, ad = rank(spec), spec.adapters[0]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": r,
            "lora_alpha": ad.scale * r, "lora_dropout": ad.dropout, "bias": "none", "inference_mode": True,
            "target_modules": [module(spec, a) for a in spec.adapters],
            "fan_in_fan_out": any(a.weight in hf.transposed for a in spec.adapters),
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None}


def save_adapter(out_dir: str | Path, spec: ModelSpec, adapters: Tree, base_model: str = "") -> Path:
    """Write ``adapters`` (a tree holding at least ``spec``'s adapter leaves) as a PEFT adapter folder."""
    if not spec.adapters:
        raise ValueError(f"this {spec.family} spec has no adapters to save; build it with lora.with_lora")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({key: get_path(adapters, path).detach().to("cpu", torch.float32).contiguous()
               for path, key in peft_keys(spec).items()}, str(out / WEIGHTS))
    (out / CONFIG).write_text(json.dumps(adapter_config(spec, base_model), indent=2) + "\n")
    return out


def load_adapter(folder: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Our adapter leaves (path -> fp32 tensor) from a PEFT adapter folder for ``spec``; a missing or misshapen
    tensor is named."""
    tensors = load_file(str(Path(folder) / WEIGHTS))
    out = {}
    for path, key in peft_keys(spec).items():
        if key not in tensors:
            raise ValueError(f"{folder}/{WEIGHTS} has no {key} (saved with other targets? its config names "
                             f"{json.loads((Path(folder) / CONFIG).read_text()).get('target_modules')})")
        if tuple(tensors[key].shape) != spec.leaf(path).shape:
            raise ValueError(f"{folder}/{WEIGHTS}: {key} is {tuple(tensors[key].shape)}, expected "
                             f"{spec.leaf(path).shape} (another rank?)")
        out[path] = tensors[key].float()
    return out


def adapted_spec(folder: str | Path, cfg: Any) -> ModelSpec:
    """The adapted spec of a PEFT adapter folder saved for a model of ``cfg`` (its rank, alpha, dropout and targets)."""
    saved = json.loads((Path(folder) / CONFIG).read_text())
    base = model_spec(cfg)
    every = with_lora(base, LoraConfig(targets=tuple(name for name, _, _ in base.lora_targets)))
    names = {module(every, ad): ad.target for ad in every.adapters}
    if unknown := [m for m in saved["target_modules"] if m not in names]:
        raise ValueError(f"{folder}/{CONFIG} adapts {unknown}, which are not {base.family}'s targets ({list(names)})")
    return with_lora(base, LoraConfig(saved["r"], saved["lora_alpha"], tuple(names[m] for m in saved["target_modules"]),
                                      saved.get("lora_dropout", 0.0)))


def merged_masters(folder: str | Path, cfg: Any, base: Tree) -> Tree:
    """The base tree of ``cfg`` (fp32 masters, as loaded from the run's ``--weights``) with the pairs of a PEFT adapter
    folder (a LoRA run's checkpoint) merged in: what an export writes as a plain Hugging Face folder."""
    spec = adapted_spec(folder, cfg)
    return merge(spec, base, run.tree_from(spec, load_adapter(folder, spec).items()))
