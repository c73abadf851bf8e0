"""Leaves read as a trainer takes them (``core.leaves``) give the trainers bit for bit what the fp32 tree loaded
whole gave them: the streamed optimizer's masters and frozen base (bf16 or NF4), the resident trainer's frozen base,
from a bf16 or an fp32 checkpoint, a Llama's fused matrices and GPT-2's transposed, tied ones; random leaves are the
seeded init (the random checkpoint's values) without a file. And the load's arithmetic and its progress lines."""
from __future__ import annotations

import pytest
import torch

from nanotrain.core.frozen import FrozenBase, frozen_paths, trainable
from nanotrain.core.leaves import Loading, held, load_peak, seeded, tree_of
from nanotrain.core.models import init_params, model_spec, preset
from nanotrain.core.models.llama.config import LlamaConfig
from nanotrain.core.models.lora import LoraConfig, with_lora
from nanotrain.core.nf4 import NF4Tensor, quantize_nf4
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.tree import named_leaves
from nanotrain.run.lora import with_pairs
from nanotrain.stream.optimizer import StreamedAdam
from weights import load_hf, open_weights, random_checkpoint

LLAMA = LlamaConfig(n_layer=2, n_embd=128, n_head=4, n_kv_head=2, intermediate_size=320, vocab_size=512, n_ctx=64)
TARGETS = {"llama": ("q", "k", "v", "o", "gate", "up", "down"), "gpt2": ("qkv", "o", "up", "down")}


def models() -> list:
    return [LLAMA, preset("tiny")]  # fused q/k/v and gate/up rows; GPT-2's transposed matrices, its tied head


def adapted(cfg):
    spec = model_spec(cfg)
    return with_lora(spec, LoraConfig(4, 8.0, TARGETS[spec.family]))


def stored(opt: StreamedAdam) -> dict[str, list[torch.Tensor]]:
    """What the streamed optimizer keeps of each leaf: its master, or its frozen copy's tensors."""
    out = {}
    for u in opt.units.values():
        out |= {p: [m] for p, m in zip(u.paths, u.master)}
        out |= {u.name + f"#{i}": list(t.parts) if isinstance(t, NF4Tensor) else [t] for i, _, t in u.base}
    return out


def streamed(spec, start, bits: int) -> dict[str, list[torch.Tensor]]:
    frozen, nf4 = frozen_paths(spec, bits)
    ocfg = OffloadConfig(device="cpu", dtype=torch.bfloat16, state_bits=8, keep_32bit=spec.fp32_moments)
    return stored(StreamedAdam(start, spec.unit_dict(), AdamConfig(), ocfg, frozen, nf4))


@pytest.mark.parametrize("cfg", models(), ids=["llama", "gpt2"])
@pytest.mark.parametrize("file_dtype", [torch.bfloat16, torch.float32])
def test_streamed_masters_and_base_from_leaves_equal_the_fp32_tree_s(cfg, file_dtype, tmp_path):
    path = random_checkpoint(cfg, 3, file_dtype, root=tmp_path)
    spec = adapted(cfg)
    for bits in (16, 4):
        whole = streamed(spec, tree_of(spec, with_pairs(spec, held(load_hf(path, cfg)), 1)), bits)  # today's path
        with open_weights(cfg, str(path)) as leaves:
            taken = streamed(spec, with_pairs(spec, leaves, 1), bits)
        assert whole.keys() == taken.keys()
        for k in whole:
            assert all(torch.equal(a, b) for a, b in zip(whole[k], taken[k])), (bits, k)
    plain = model_spec(cfg)  # full training: every leaf a master
    whole = streamed(plain, load_hf(path, cfg), 16)
    with open_weights(cfg, str(path)) as leaves:
        taken = streamed(plain, leaves, 16)
    fp32 = dict(named_leaves(load_hf(path, cfg)))  # and each master is the checkpoint's tensor, widened
    assert all(torch.equal(whole[k][0], taken[k][0]) and torch.equal(taken[k][0], fp32[k].reshape(-1)) for k in whole)


def test_the_resident_frozen_base_from_leaves_equals_the_fp32_tree_s(tmp_path):
    path = random_checkpoint(LLAMA, 4, torch.bfloat16, root=tmp_path)
    spec = adapted(LLAMA)
    whole = FrozenBase(spec, held(load_hf(path, LLAMA)), torch.device("cpu"), torch.bfloat16, 4)
    with open_weights(LLAMA, str(path)) as leaves:
        taken = FrozenBase(spec, leaves, torch.device("cpu"), torch.bfloat16, 4)
    for p, t in whole.store.items():
        parts = (t.parts, taken.store[p].parts) if isinstance(t, NF4Tensor) else ((t,), (taken.store[p],))
        assert all(torch.equal(a, b) for a, b in zip(*parts)), p
    expected = quantize_nf4(load_hf(path, LLAMA)["blocks"][1]["gate_up_w"])  # the fp32 leaf quantised
    assert all(torch.equal(a, b) for a, b in zip(expected.parts, taken.store["blocks.1.gate_up_w"].parts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_leaves_are_the_seeded_init_and_the_random_checkpoint_s(dtype, tmp_path):
    spec = model_spec(LLAMA)
    with open_weights(LLAMA, "random", seed=5, random_dtype=dtype) as leaves:
        made = dict((p, leaves.read(p)) for p in spec.shapes)
    init = dict(named_leaves(init_params(LLAMA, seed=5)))
    written = dict(named_leaves(load_hf(random_checkpoint(LLAMA, 5, dtype, root=tmp_path), LLAMA, dtype=dtype)))
    for p, t in made.items():
        assert t.dtype == dtype and torch.equal(t, init[p].to(dtype)) and torch.equal(t, written[p]), p


def test_seeded_leaves_skip_forward_and_refuse_to_go_back():
    spec = model_spec(LLAMA)
    leaves, init = seeded(spec, 2), dict(named_leaves(init_params(LLAMA, seed=2)))
    last = spec.leaves[-1].path
    assert torch.equal(leaves.read(last), init[last])  # the leaves before it drawn and dropped
    with pytest.raises(ValueError, match="drawn in the model's order"):
        leaves.read(spec.leaves[0].path)


def test_trainable_leaves_are_read_into_the_masters_home():
    # masters on the GPU: each leaf goes there as it is read, the model is never whole in host memory ("meta"
    # stands in for the GPU on the CPU: a tensor put there holds no memory anywhere)
    spec = model_spec(LLAMA)
    tree = trainable(spec, seeded(spec, 0), torch.device("meta"))
    got = dict(named_leaves(tree))
    assert sorted(got) == sorted(spec.shapes)
    assert all(t.device.type == "meta" and t.dtype == torch.float32 for t in got.values())
    init = dict(named_leaves(init_params(LLAMA, seed=0)))
    assert all(torch.equal(t, init[p]) for p, t in named_leaves(trainable(spec, seeded(spec, 0))))  # default: host


def test_load_peak_counts_what_is_kept_and_what_is_in_flight():
    # a reader: each unit's kept bytes pile up, the peak is the last unit's end with its leaf in flight
    assert load_peak([(10, 4), (20, 30), (5, 1)]) == max(10 + 4, 10 + 20 + 30, 35 + 1)


def test_loading_says_its_progress_and_names_non_finite_leaves(capsys):
    spec = model_spec(LLAMA)
    tree = init_params(LLAMA)
    tree["blocks"][1]["o_w"][0, 0] = float("nan")
    loading = Loading(spec, "tiny weights", every_s=0.0)
    tree_of(spec, loading.watch(held(tree)))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(spec.leaves) and lines[0].startswith("loading tiny weights: 1/4 units")
    assert lines[-1].startswith(f"loading tiny weights: 4/4 units, {spec.costs.total_params / 1e9:.2f}B of ")
    assert loading.bad == ["blocks.1.o_w"]
