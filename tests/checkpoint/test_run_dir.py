"""A run folder under kills: a save or re-save killed at every file-system call leaves `latest` (or the
fallback) on a complete checkpoint that resumes; stale temporaries go at the next start; retention."""
import os
import shutil

import pytest
import torch

from nanotrain.core import models as M
from nanotrain.core.models import preset
from nanotrain.data import DataPosition
from nanotrain.checkpoint.run_dir import find_checkpoint, prune, remove_stale
from nanotrain.checkpoint.resume import load_masters, restore
from nanotrain.checkpoint.state import save_checkpoint
from nanotrain.core.train.shard import whole_shard
from nanotrain.core.tree import named_leaves, set_path
from weights import CheckpointError

CFG = preset("tiny", vocab_size=64, n_embd=8, n_head=2, n_layer=1, n_ctx=16)
SHARD = "shard-00000-of-00001.safetensors"  # one process's shard of whole leaves


class Toy:
    """The Trainer's state half: weights whose every value is the step count, and a step-count state."""

    def __init__(self, step=0):
        self.cfg, self.spec, self.step_count = CFG, M.model_spec(CFG), step
        self.params = M.init_params(CFG)

    def at(self, step):
        self.step_count = step
        for _, t in named_leaves(self.params):
            t.fill_(step)
        return self

    def master_params(self):
        return self.params

    def state_dict(self):
        return {"steps": torch.tensor(self.step_count), **{f"master.{p}": t for p, t in named_leaves(self.params)}}

    def load_state_dict(self, sd):
        for key, t in sd.items():
            if key.startswith("master."):
                set_path(self.params, key.removeprefix("master."), t)

    def shard_state(self):
        return whole_shard(self.spec, self.state_dict(), None)

    load_shard_state = load_state_dict


class Killed(BaseException):
    """The process died: raised at the k-th file-system call, and at every call after it."""


def kill_at(monkeypatch, k):
    calls = {"n": 0}
    for mod, name in [(os, "replace"), (os, "rename"), (os, "unlink"), (os, "rmdir"), (os, "fsync"),
                      (os, "mkdir")]:
        real = getattr(mod, name)

        def fake(*a, real=real, **kw):
            calls["n"] += 1
            if calls["n"] >= k:
                raise Killed
            return real(*a, **kw)

        monkeypatch.setattr(mod, name, fake)
    return calls


def save(run, step):
    return save_checkpoint(run, Toy().at(step), DataPosition(0, step), {"model": "toy"})


def resumed_step(run):
    """What a resume finds: its step, after checking every tensor holds that step's value."""
    ckpt = find_checkpoint(run).path
    trainer = Toy()
    pos = restore(trainer, ckpt)
    masters = load_masters(ckpt)
    assert all(bool((t == trainer.step_count).all()) for t in masters.values())
    assert pos.index == trainer.step_count
    return trainer.step_count


@pytest.mark.parametrize("resave", [False, True], ids=["save", "re-save"])
def test_a_save_killed_at_every_point_leaves_a_checkpoint_that_resumes(tmp_path, monkeypatch, resave):
    k = 1
    while True:
        run = tmp_path / f"k{k}"
        save(run, 1)
        save(run, 2)
        with monkeypatch.context() as m:
            calls = kill_at(m, k)
            try:
                save(run, 2 if resave else 3)  # re-save: a resumed run saves step 2 over the existing folder
                finished = True
            except Killed:
                finished = False
        expected = {2, 3} if not resave else {2}
        assert resumed_step(run) in expected, f"killed at call {k}"
        remove_stale(run)  # the next start
        assert resumed_step(run) in expected
        save(run, 3)  # the resumed run goes on and saves
        assert resumed_step(run) == 3
        assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == [], f"killed at call {k}"
        if finished:
            break
        k += 1
    assert k > 10 and calls["n"] < k  # every call was a kill point, the last run had none


def test_resume_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    (tmp_path / "step-000002" / SHARD).unlink()  # half-deleted, as an old re-save left it
    ckpt, note, corrupt = find_checkpoint(tmp_path)
    assert ckpt.name == "step-000001" and corrupt == ()
    assert note == (f"step-000002 is incomplete (no {SHARD}); resuming from step-000001, the newest intact "
                    f"checkpoint")
    (tmp_path / "latest").unlink()
    assert find_checkpoint(tmp_path).note.startswith("no 'latest' file; resuming from step-000001")
    shutil.rmtree(tmp_path / "step-000001")
    with pytest.raises(CheckpointError, match=r"nothing to resume in .*: no 'latest' file; step-000002 is incomplete "
                                              r"\(no shard-00000-of-00001.safetensors\), and no intact step-N"):
        find_checkpoint(tmp_path)


def test_stale_temporaries_go_and_retention_keeps_the_newest(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step)
    dead = 2**22 + 12345  # above the default pid_max: no such process
    (tmp_path / f".step-000004.tmp-{dead}").mkdir()
    (tmp_path / f".step-000002.old-{dead}").mkdir()
    (tmp_path / f".latest.tmp-{dead}").write_text("x")
    (tmp_path / f".step-000005.tmp-{os.getppid()}").mkdir()  # a live process's save: left alone
    removed = remove_stale(tmp_path)
    assert removed == [f".latest.tmp-{dead}", f".step-000002.old-{dead}", f".step-000004.tmp-{dead}"]
    assert (tmp_path / f".step-000005.tmp-{os.getppid()}").exists()
    save_checkpoint(tmp_path, Toy().at(4), DataPosition(), keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000003", "step-000004"]
    # the one `latest` names stays even when it is not among the newest (a kill before `latest` moved on)
    (tmp_path / "latest").write_text("step-000003\n")
    assert prune(tmp_path, 1) == []
    save_checkpoint(tmp_path, Toy().at(5), DataPosition(), keep_last=1)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000005"]


def test_a_checkpoint_of_another_model_is_named_before_anything_is_built(tmp_path):
    import json

    from nanotrain.run.folder import check_model
    from weights import hf_config

    (tmp_path / "config.json").write_text(json.dumps(hf_config(preset("tiny"))))
    check_model(tmp_path, preset("tiny"), "tiny", "tiny")
    with pytest.raises(CheckpointError, match=r"is tiny \(2 layers x 64 wide\); you asked for gpt2 \(12 x 768\): "
                                              r"pass --model tiny or leave --model out"):
        check_model(tmp_path, preset("gpt2"), "gpt2", "tiny")
    with pytest.raises(CheckpointError, match=r"is another model \(2 layers x 64 wide\); you asked for tiny-llama"):
        check_model(tmp_path, preset("tiny-llama"), "tiny-llama", None)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(preset("tiny-llama"))))  # any family's config.json
    check_model(tmp_path, preset("tiny-llama"), "tiny-llama", "tiny-llama")
    with pytest.raises(CheckpointError, match=r"is tiny-llama \(2 layers x 48 wide\); you asked for tiny-llama "
                                              r"\(3 x 48\)"):
        check_model(tmp_path, preset("tiny-llama", n_layer=3), "tiny-llama", "tiny-llama")
