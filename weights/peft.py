"""Adapters in PEFT's layout: a folder with ``adapter_config.json`` and ``adapter_model.safetensors`` under PEFT's
key names, which ``peft.PeftModel.from_pretrained`` loads on ``transformers``' model of the base.

A pair's module is the Hugging Face tensor its target's rows are (``HFLayout.block``: Llama's ``q`` is the first
tensor of the fused ``qkv_w``, ``self_attn.q_proj``); PEFT's A and B are ``[r, in]`` and ``[out, r]`` as ours,
also on GPT-2's ``Conv1D`` (only its merge transposes: ``fan_in_fan_out``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nanotrain.core.models import family_of
from nanotrain.core.models.lora import Adapter, rank
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
