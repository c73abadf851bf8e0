"""Checkpoints carry their files' SHA-256 (SHA256SUMS, sha256sum's format): a file that changed after the save
is named, never trained on or exported, and a resume falls back to the newest intact checkpoint, in one line.
Every checkpoint gets them, and the old layouts that published through checkpoint.run_dir had them."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

import pytest
import torch

from nanotrain.data import DataPosition
from nanotrain.checkpoint.checksums import SUMS, file_sha256, read_sums, verify, write_sums
from nanotrain.checkpoint.disk import write_tensors
from nanotrain.checkpoint.run_dir import find_checkpoint, publish, set_aside, write_durably
from nanotrain.checkpoint.state import save_checkpoint
from nanotrain.core.models import preset
from weights.safetensors_io import CheckpointError, write_safetensors
from tests.conftest import SHAKESPEARE, TOKENIZER_DIR
from tests.task_losses import assert_first_losses
from tests.checkpoint.test_run_dir import SHARD, Toy


def flip(path, offset=4096, n=4096) -> None:
    """What the issue did: 4096 bytes of a file inverted in place (a bad disk, a bad copy)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def test_the_digest_taken_while_writing_is_the_file_s(tmp_path):
    tensors = {"a": torch.randn(1000, 33), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(0)}
    digest = hashlib.sha256()
    path = write_safetensors(tmp_path / "x.safetensors", [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()],
                             iter(tensors.values()), digest=digest)
    assert digest.hexdigest() == file_sha256(path)


def test_publish_lists_every_file_and_sha256sum_agrees(tmp_path):
    for step in (1, 2):
        save_checkpoint(tmp_path, Toy().at(step), DataPosition(0, step))
    ckpt = tmp_path / "step-000002"
    sums = read_sums(ckpt)
    assert sorted(sums) == ["config.json", "manifest.json", SHARD, "trainer.json"]
    assert all(file_sha256(ckpt / name) == digest for name, digest in sums.items())
    assert not list(ckpt.glob(".*"))  # the digests the writers left beside their files are collected
    assert verify(ckpt)
    if shutil.which("sha256sum"):  # checkable without nanotrain
        assert subprocess.run(["sha256sum", "--quiet", "-c", SUMS], cwd=ckpt).returncode == 0


@pytest.mark.parametrize("name", [SHARD, "manifest.json", "trainer.json"])
def test_a_corrupted_file_is_named_and_the_resume_falls_back(tmp_path, name):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, Toy().at(step), DataPosition(0, step))
    bad = tmp_path / "step-000003" / name
    flip(bad, offset=0 if name.endswith(".json") else 4096, n=min(4096, bad.stat().st_size))
    with pytest.raises(CheckpointError, match=f"{bad} does not match its SHA-256 in SHA256SUMS"):
        verify(bad.parent)
    found = find_checkpoint(tmp_path)
    assert found.path.name == "step-000002" and found.corrupt == (bad.parent,)
    assert found.note == (f"{bad} does not match its SHA-256 in SHA256SUMS: it changed after it was saved (disk, "
                          f"copy or edit); resuming from step-000002, the newest intact checkpoint")
    assert set_aside(found.corrupt) == [tmp_path / "step-000003.corrupt"]
    assert (tmp_path / "step-000003.corrupt" / name).is_file()  # kept to inspect, out of resumes and retention
    assert find_checkpoint(tmp_path).path.name == "step-000002"
    flip(tmp_path / "step-000002" / SHARD)
    flip(tmp_path / "step-000001" / "manifest.json", offset=0, n=16)
    with pytest.raises(CheckpointError, match=f"nothing to resume in .*: .*step-000002/{SHARD} does not "
                                              f"match its SHA-256 .*, and no intact step-N folder"):
        find_checkpoint(tmp_path)


def test_a_missing_file_or_a_damaged_list_is_named(tmp_path):
    save_checkpoint(tmp_path, Toy().at(1), DataPosition())
    save_checkpoint(tmp_path, Toy().at(2), DataPosition())
    (tmp_path / "step-000002" / SHARD).unlink()
    assert find_checkpoint(tmp_path).note.startswith(f"step-000002 is incomplete (no {SHARD})")
    (tmp_path / "step-000001" / SUMS).write_text("not a checksum line\n")
    with pytest.raises(CheckpointError, match=r"step-000001/SHA256SUMS line 1 is not '<sha256>  <file>'"):
        verify(tmp_path / "step-000001")


def test_a_checkpoint_saved_before_checksums_resumes_and_says_it_is_not_verified(tmp_path):
    save_checkpoint(tmp_path, Toy().at(1), DataPosition())
    (tmp_path / "step-000001" / SUMS).unlink()
    assert verify(tmp_path / "step-000001") is False
    found = find_checkpoint(tmp_path)
    assert found.path.name == "step-000001"
    assert found.note == "step-000001 has no SHA256SUMS (saved before checksums): its files are not verified"


def test_other_formats_get_them_through_publish(tmp_path):
    """A 3D-style folder (layout.json and per-shard tensor files, as parallel3d.checkpoint writes it): its shard
    files hashed as written, its manifest read back; resume falls back and consolidate --verify names the file."""
    from tasks.consolidate import main as consolidate

    for step in (1, 2):
        tmp = tmp_path / f".step-{step:06d}.tmp-1"
        tmp.mkdir()
        for shard in ("tp0-pp0", "tp1-pp0"):
            t = torch.full((64, 64), float(step))
            write_tensors(tmp / f"{shard}.safetensors", [("param.w", (64, 64), torch.float32)], iter([t]))
        write_durably(tmp / "layout.json", json.dumps({"step": step, "files": ["tp0-pp0.safetensors",
                                                                               "tp1-pp0.safetensors"]}))
        publish(tmp_path, tmp, tmp_path / f"step-{step:06d}")
    assert sorted(read_sums(tmp_path / "step-000002")) == ["layout.json", "tp0-pp0.safetensors", "tp1-pp0.safetensors"]
    consolidate([str(tmp_path / "step-000002"), "--verify"])
    flip(tmp_path / "step-000002" / "tp1-pp0.safetensors", offset=200, n=100)
    with pytest.raises(SystemExit, match=r"error: .*step-000002/tp1-pp0.safetensors does not match its SHA-256"):
        consolidate([str(tmp_path / "step-000002"), "--verify"])
    with pytest.raises(SystemExit, match=r"tp1-pp0.safetensors does not match"):  # and before an export
        consolidate([str(tmp_path / "step-000002"), "--out", str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()
    assert find_checkpoint(tmp_path).path.name == "step-000001"


def test_write_sums_reads_back_what_no_writer_hashed(tmp_path):
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "b.bin").write_bytes(b"\x00" * 10)
    write_sums(tmp_path)
    assert read_sums(tmp_path) == {"a.json": hashlib.sha256(b"{}").hexdigest(),
                                   "b.bin": hashlib.sha256(b"\x00" * 10).hexdigest()}


def test_finetune_resumes_a_corrupted_zero2_sharded_run_from_the_newest_intact_checkpoint(
        offline_files, tmp_path, monkeypatch, capfd):
    """The issue's case: a shard of a ZeRO-2 sharded checkpoint with 4096 bytes flipped. The resume names it,
    sets it aside, resumes the checkpoint before, and the losses after it are the uninterrupted run's."""
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    common = ["--model", "tiny", "--batch", "4", "--seq", "32", "--data", str(SHAKESPEARE), "--tokenizer-dir",
              str(TOKENIZER_DIR), "--lr", "1e-3", "--no-tensorboard", "--dp", "2", "--zero", "2", "--sharded-save"]
    main(common + ["--out", "run", "--steps", "3", "--save-every", "1"])
    losses = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open())}
    shard = tmp_path / "run" / "step-000003" / "shard-00001-of-00002.safetensors"
    flip(shard)
    capfd.readouterr()
    main(["--out", "run", "--resume"])
    out = capfd.readouterr().out  # the ranks' output too
    assert ("warning: run/step-000003/shard-00001-of-00002.safetensors does not match its SHA-256 in SHA256SUMS: it "
            "changed after it was saved (disk, copy or edit); resuming from step-000002, the newest intact "
            "checkpoint\n") in out
    assert "set aside run/step-000003.corrupt" in out and "resumed from run/step-000002 at step 2" in out
    again = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open())}
    assert again.keys() == losses.keys()
    # step 3 from the same state (step-000002's) at the same layout: the loss chain's bound (conftest)
    assert_first_losses([again[3]], [losses[3]], preset("tiny"), 32, 4 * 32)
    assert verify(tmp_path / "run" / "step-000003")  # saved again, whole
