"""An export streams (issue 38): a checkpoint's masters are read a leaf at a time and written before the next is
read, so what an export holds is one leaf in fp32 and one of its file tensors, not the model's masters; its files
are byte for byte those of the masters held whole and exported, at every layout a checkpoint is saved in.

The bound is counted, not sampled: the memory of every leaf the checkpoint reader returns and of every tensor the
writer hands to the file is followed until it is freed (a leaf's counts while any view of it lives), and the most
bytes alive at once is the peak. The same count over the masters read whole first (what the export
did before) is their total, which is past the bound: the count sees what is held.
"""
from __future__ import annotations

import json
import weakref
from math import prod

import pytest
import torch

import weights.safetensors_io as safetensors_io
from nanotrain.checkpoint.export import ExportConfig, export_checkpoint, export_masters
from nanotrain.checkpoint.resume import load_masters
from nanotrain.checkpoint.slices import FORMAT, MANIFEST, SliceReader
from nanotrain.core.models import init_params, model_spec, preset
from nanotrain.core.tree import named_leaves
from nanotrain.tensor_parallel.shard import TPPlan, axis_ranges, shard_leaf
from weights import CheckpointError, hf_config
from weights.table import table

MODELS = {"gpt2": preset("tiny", vocab_size=320), "llama": preset("tiny-llama")}  # Conv1D's transposes; fused qkv
LAYOUTS = ("one process", "zero 2", "tp 2")


def write_checkpoint(folder, cfg, masters: dict[str, torch.Tensor], layout: str) -> None:
    """``masters`` as the one format holds them at ``layout``: one file of whole leaves; two ranks' files each
    holding a flat half of every leaf (ZeRO's pieces); two tensor-parallel ranks' cuts (``shard_leaf``)."""
    from safetensors.torch import save_file

    spec, shards = model_spec(cfg), []
    folder.mkdir(parents=True)
    for rank in range(1 if layout == "one process" else 2):
        file, tensors, pieces = f"shard-{rank:05d}-of-00002.safetensors", {}, []
        for path, t in masters.items():
            if layout == "tp 2":
                t = shard_leaf(path, t, TPPlan(spec, None, False, *axis_ranges(spec, 2, rank)))
            flat, half = t.reshape(-1), t.numel() // 2
            lo, hi = ((0, t.numel()) if layout != "zero 2" else (0, half) if rank == 0 else (half, t.numel()))
            name = path if layout != "zero 2" else f"{path}@{lo}"
            tensors[f"master.{name}"] = flat[lo:hi].clone()
            pieces.append([name, path, lo, hi])
        save_file(tensors, folder / file)
        shards.append({"file": file, "tp": [rank, 2] if layout == "tp 2" else None, "pieces": pieces})
    manifest = {"format": FORMAT, "step": 1, "layout": {}, "block": None, "scalars": [],
                "files": [s["file"] for s in shards], "shards": shards}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    (folder / "config.json").write_text(json.dumps(hf_config(cfg)))
    (folder / "trainer.json").write_text(json.dumps({"step": 1, "data_position": None}))


class Alive:
    """The memory of the tensors followed that is still alive, by kind: how many blocks at most, and the most bytes
    at once. A tensor's memory is its storage, which lives while any tensor over it does (a view, a detached one);
    a tensor over memory already followed (a part of a leaf written as it is) adds nothing."""

    def __init__(self):
        self.bytes = self.peak = 0
        self.count: dict[str, int] = {"read": 0, "written": 0}
        self.most = dict(self.count)
        self.followed: set[int] = set()

    def follow(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        storage = t.untyped_storage()  # one Python object per storage while it lives
        if id(storage) not in self.followed:
            n = storage.nbytes()
            self.followed.add(id(storage))
            self.bytes += n
            self.count[kind] += 1
            self.peak, self.most[kind] = max(self.peak, self.bytes), max(self.most[kind], self.count[kind])
            weakref.finalize(storage, self._freed, id(storage), n, kind)
        return t

    def _freed(self, key: int, n: int, kind: str) -> None:
        self.followed.discard(key)
        self.bytes -= n
        self.count[kind] -= 1


@pytest.fixture
def alive(monkeypatch) -> Alive:
    """Every leaf the checkpoint reader returns and every tensor the safetensors writer writes, followed."""
    counter, whole, raw_bytes = Alive(), SliceReader.whole, safetensors_io._raw_bytes
    monkeypatch.setattr(SliceReader, "whole", lambda self, kind, path: counter.follow(whole(self, kind, path), "read"))
    monkeypatch.setattr(safetensors_io, "_raw_bytes", lambda t: raw_bytes(counter.follow(t, "written")))
    return counter


def files_of(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_an_export_holds_one_leaf_and_writes_the_bytes_of_the_masters_held_whole(family, layout, dtype, tmp_path,
                                                                                  alive):
    cfg = MODELS[family]
    masters = dict(named_leaves(init_params(cfg, seed=3)))
    ckpt = tmp_path / "step-000001"
    write_checkpoint(ckpt, cfg, masters, layout)
    leaf = max(t.numel() * 4 for t in masters.values())  # the largest leaf in fp32
    file_tensor = max(prod(p.shape) for e in table(cfg) for p in e.parts) * dtype.itemsize  # and part in the file
    ecfg = ExportConfig(dtype, max_shard_bytes=leaf)  # shards of several tensors, at least three of them
    total = sum(t.numel() * 4 for t in masters.values())
    assert total > 2 * (ecfg.max_shard_bytes + leaf)  # a model whose masters are past the bound

    files = export_checkpoint(ckpt, tmp_path / "streamed", ecfg=ecfg)
    assert len([f for f in files if f.name.startswith("model-")]) >= 3
    # The bound: one leaf read and one tensor being written at a time (<= one leaf + one shard).
    assert alive.most["read"] == 1 and alive.most["written"] <= 1 and alive.bytes == 0, alive.most
    assert alive.peak <= leaf + file_tensor, (alive.peak, leaf, file_tensor)

    alive.peak = 0
    held = load_masters(ckpt)  # what the export did before: every master read, then written
    export_masters(held, cfg, tmp_path / "held", ecfg=ecfg)
    assert alive.peak >= total  # the count sees the masters held
    assert files_of(tmp_path / "streamed") == files_of(tmp_path / "held")  # every file, byte for byte
    assert all(torch.equal(held[path], t) for path, t in masters.items())  # the layout read back whole


def test_a_value_beyond_the_range_is_refused_naming_its_leaf_and_the_export_there_stays(tmp_path):
    """The range is checked as each leaf is read: the last leaf's refusal comes after the others were written, into
    the temporary folder, which goes; the export already in ``out`` is left whole."""
    cfg = MODELS["llama"]
    masters = dict(named_leaves(init_params(cfg, seed=3)))
    last = model_spec(cfg).leaves[-1].path
    write_checkpoint(tmp_path / "good", cfg, masters, "zero 2")
    export_checkpoint(tmp_path / "good", tmp_path / "out", ecfg=ExportConfig(torch.float16))
    before = files_of(tmp_path / "out")
    masters[last].view(-1)[-1] = -7e4  # beyond fp16's 65504
    write_checkpoint(tmp_path / "big", cfg, masters, "zero 2")
    with pytest.raises(CheckpointError, match=rf"^{last} holds 7e\+04, beyond float16's largest value 6.55e\+04: "
                                              rf"export in bf16 or fp32$"):
        export_checkpoint(tmp_path / "big", tmp_path / "out", ecfg=ExportConfig(torch.float16))
    assert files_of(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big", "good", "out"]  # no temporary folder left
    export_checkpoint(tmp_path / "big", tmp_path / "out", ecfg=ExportConfig(torch.bfloat16))  # bf16's range holds it
