"""The benchmark's DTensor peer computes the same model as nanotrain's engine (CPU, gloo, 2 ranks).

Without this, a faster peer in bench_tp could be a different (wrong) model: same loss, same
gradients through the tied embedding and the split q/k/v, and the same losses over AdamW steps.
"""
from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from nanotrain.core import models
from nanotrain.core.models import model_spec, preset
from nanotrain.core.tree import named_leaves
from nanotrain.distributed import GridConfig, build_grid, run_in_group, spawn
from nanotrain.tensor_parallel.shard import unshard_leaf
from tasks.bench.tp import nanotrain_step
from tasks.bench.peers.dtensor import dtensor_step, parallelize_peer, peer_from_tree, peer_loss
from tests.conftest import adam_bounds, chain_rtol, model_chain, rel_err
from tests.tensor_parallel.test_tp_gpt2 import leaves_requiring_grad

CFG = preset("tiny", n_layer=2, n_embd=32, n_head=4, vocab_size=251, n_ctx=32)
HP = SimpleNamespace(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)  # torch.optim.AdamW's, as both bench steps build it


def recorded(sides: dict[str, tuple[Callable, Callable]], steps: int) -> tuple[dict, dict]:
    """Each side's losses over ``steps`` calls of its step, taking turns, and the whole gradients its AdamW applied
    at each (``sides``: name -> (step, what reads them from the optimizer), read before its first one's update)."""
    losses, grads, pending = {k: [] for k in sides}, {k: [] for k in sides}, []

    def before_update(opt: torch.optim.Optimizer, *_) -> None:
        if pending:  # the step's first optimizer (the peer may hold two)
            name = pending.pop()
            grads[name].append(sides[name][1](opt))
    handle = register_optimizer_step_pre_hook(before_update)
    try:
        for _ in range(steps):
            for name, (step, _) in sides.items():
                pending.append(name)
                losses[name].append(step().item())
    finally:
        handle.remove()
    return losses, grads


def _our_grads(local: dict, grid) -> dict[str, torch.Tensor]:
    """The engine's gradients (summed across the group where partial), whole, by path."""
    spec, out = model_spec(CFG), {}
    for path, t in named_leaves(local):
        shards = [torch.empty_like(t.grad) for _ in range(grid.tp)]
        dist.all_gather(shards, t.grad.contiguous(), group=grid.tp_group)
        out[path] = unshard_leaf(path, shards, spec).clone()
    return out


def _peer_grads(peer, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The peer's gradients as its AdamW ``opt`` takes them, whole, by the tree's paths (``peer_from_tree``'s
    inverse)."""
    from torch.distributed.tensor import DTensor

    shards = dict(zip(map(id, peer.parameters()), opt.param_groups[0]["params"]))  # the local optimizer's, in order

    def whole(p: torch.Tensor) -> torch.Tensor:
        g = p.grad if p.grad is not None else shards[id(p)].grad  # the local optimizer's: moved to the shard
        if isinstance(p, DTensor):
            g = (g if isinstance(g, DTensor) else DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape,
                                                                           stride=p.stride())).full_tensor()
        return g.detach().clone()

    out = {"wte": whole(peer.emb.wte.weight)[:CFG.vocab_size], "wpe": whole(peer.emb.wpe.weight),
           "ln_f_w": whole(peer.ln_f.weight), "ln_f_b": whole(peer.ln_f.bias)}
    for i, blk in enumerate(peer.blocks):
        qkv = (blk.attn.q, blk.attn.k, blk.attn.v)
        out[f"blocks.{i}.qkv_w"] = torch.cat([whole(lin.weight) for lin in qkv])
        out[f"blocks.{i}.qkv_b"] = torch.cat([whole(lin.bias) for lin in qkv])
        for mod, name in ((blk.ln_1, "ln_1"), (blk.ln_2, "ln_2"), (blk.attn.proj, "proj"), (blk.mlp.fc, "fc"),
                          (blk.mlp.proj, "fc_proj")):
            out[f"blocks.{i}.{name}_w"], out[f"blocks.{i}.{name}_b"] = whole(mod.weight), whole(mod.bias)
    return out


def _peer(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import loss_parallel

    grid = build_grid(GridConfig(tp=2))
    g = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, CFG.vocab_size, (2, 2, 16), generator=g)
    full = leaves_requiring_grad(models.init_params(CFG, 0))
    ref = models.loss(full, tokens, targets, CFG)
    ref.backward()
    c, want = CFG.n_embd, {path: t.grad for path, t in named_leaves(full)}
    loss_rtol, grad_rtol = (chain_rtol(model_chain(CFG, 16, tokens.numel(), what)) for what in ("loss", "grads"))
    for sp in (False, True):
        mesh = DeviceMesh.from_group(grid.tp_group, "cpu")
        peer = parallelize_peer(peer_from_tree(models.init_params(CFG, 0), CFG), mesh, sp)
        with loss_parallel():
            loss = peer_loss(peer, tokens, targets)
            loss.backward()
        assert rel_err(loss.full_tensor(), ref) < loss_rtol, f"peer loss differs (sp={sp})"
        checks = {"wte (embedding + tied head)": (peer.emb.wte.weight, full["wte"].grad),
                  "k of block 1": (peer.blocks[1].attn.k.weight, full["blocks"][1]["qkv_w"].grad[c:2 * c]),
                  "ln_2 of block 0": (peer.blocks[0].ln_2.weight, full["blocks"][0]["ln_2_w"].grad)}
        for name, (p, expected) in checks.items():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            assert rel_err(grad, expected) < grad_rtol, f"peer gradient of {name} differs (sp={sp})"
        args = (models.init_params(CFG, 0), CFG, grid, sp, tokens, targets, torch.device("cpu"), 1e-3)
        for local in (True, False):  # AdamW on the local shards or on the DTensors
            ours, peers = nanotrain_step(*args), dtensor_step(*args, pad_vocab=False, local_optimizer=local)
            losses, grads = recorded({"ours": (ours, lambda _: _our_grads(ours.params, grid)),
                                      "peer": (peers, lambda opt: _peer_grads(peers.peer, opt))}, 3)
            for side, path in ((side, path) for side in grads for path in want):  # what each side applied at the
                err = rel_err(grads[side][0][path], want[path])  # first step: the gradients checked above, whole
                assert err <= grad_rtol, f"{side}'s first gradient of {path} off by {err:.2e} (sp={sp}, local={local})"
            # the first from the same weights: the loss chain's bound; the later after AdamW steps, plus what the
            # distance of the weights, by the gradients each side applied, moves them (conftest.adam_bounds)
            moved = adam_bounds(dict(named_leaves(models.init_params(CFG, 0))), grads["peer"], grads["ours"], HP)[1]
            for i, (a, b, m) in enumerate(zip(losses["ours"], losses["peer"], moved, strict=True)):
                assert abs(a - b) <= loss_rtol * b + m, \
                    f"step {i}: nanotrain {a} != DTensor peer {b} (bound {m:.1e} + chain; sp={sp}, local={local})"
    # With Megatron's padding (the bench's default) the zero padding logits join the softmax.
    padded = dtensor_step(*args, pad_vocab=True)().item()
    assert 0 < padded - ref.item() < 2 * (256 - CFG.vocab_size) / CFG.vocab_size, f"padded peer loss {padded}"


def test_dtensor_peer_is_the_same_model():
    spawn(run_in_group, 2, ("gloo", _peer), timeout_s=120, start_method="fork")


def test_time_windows_times_each_window_after_one_warm_up():
    from tasks.bench.common import time_windows

    calls = []
    windows = time_windows(lambda: calls.append(1), warmup=2, steps=3, windows=4)
    assert len(windows) == 4 and all(w >= 0 for w in windows) and len(calls) == 2 + 3 * 4


def _bench(argv: list[str]) -> None:
    from tasks.bench import tp

    compiled = []
    torch.nn.Module.compile = lambda self, *a, **k: compiled.append(type(self).__name__)  # no inductor in CI
    tp.main(argv)
    configs = 3 if os.environ["RANK"] == "0" else 2  # tp=1 runs on rank 0 alone; tp=2 with sp off and on on both
    assert compiled == ["Block"] * 2 * configs, compiled  # tiny's 2 blocks, once per configuration


def test_the_bench_reports_windows_and_compiles_the_peer_per_block(tmp_path):
    """The harness on CPU (its times mean nothing): every row has its windows, the median between the
    slowest and fastest, and ``--peer-compile on`` compiles each of the peer's blocks once per configuration."""
    import json

    out = tmp_path / "tp.json"
    argv = ["--model", "tiny", "--heads", "4", "--weights", "init", "--device", "cpu", "--tp", "1,2",
            "--batch", "2", "--seq", "32",
            "--warmup", "1", "--steps", "1", "--windows", "3", "--peer-compile", "on", "--out", str(out)]
    spawn(_bench, 2, (argv,), timeout_s=120, start_method="fork")
    rows = json.loads(out.read_text())["rows"]
    assert {r["name"] for r in rows} >= {"nanotrain tp=1", "dtensor tp=1 compiled", "dtensor tp=2 sp compiled"}
    for r in rows:
        w = r["extra"]["window_tok_s"]
        assert len(w) == 3 and min(w) <= r["tokens_per_s"] <= max(w), r
