"""On 2 GPUs with NCCL (skipped elsewhere): tensor parallelism with 5 heads (3/2), with and without
sequence parallelism and ``--tp-overlap``, equals one GPU in fp32 (loss and every gradient), and under
bf16 autocast stays as close to the fp32 truth as one GPU in bf16 does. This exercises what the CPU
tests cannot: NCCL's grouped point-to-point ring steps and asynchronous all-reduces on their own
stream while the matmuls run, in forward and in backward's autograd thread. Each mode runs eager and
with its blocks compiled by inductor (``tensor_parallel.ops``, ``plan.compile``), held to the same bounds.

    python -m pytest -q tests/tensor_parallel/test_tp_overlap_cuda.py
"""
from __future__ import annotations

import pytest
import torch

from nanotrain.core import models
from nanotrain.core.models import preset
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, spawn
from nanotrain.tensor_parallel import parallel_loss, plan_tp, shard_params, sync_grads
from nanotrain.core.tree import named_leaves, tree_map
from tests.conftest import rel_err
from tests.tensor_parallel.test_tp_gpt2 import leaves_requiring_grad
from tests.tensor_parallel.test_tp_overlap import MODES

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

CFG = preset("tiny", n_layer=4, n_embd=320, n_head=5, vocab_size=1000, n_ctx=256)
TOL = 1e-5  # fp32 on GPUs: cuBLAS picks other kernels (other summation orders) for the shards' shapes


def step(fn, params, autocast: bool, device: torch.device):
    leaves = leaves_requiring_grad(params)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = fn(leaves)
    loss.backward()
    return loss.detach(), leaves


def worker(backend: str = "nccl") -> list[str]:
    """Every check's failure, as text (nothing when all pass)."""
    ctx = init_distributed(GridConfig(tp=2), backend, timeout_s=120)
    failures = []
    with ctx.guard():
        device = ctx.device
        g = torch.Generator().manual_seed(0)
        tokens, targets = (torch.randint(0, CFG.vocab_size, (4, 128), generator=g).to(device) for _ in range(2))
        full = tree_map(lambda t: t.to(device), models.init_params(CFG, 0))
        refs = {}
        for autocast in (False, True):
            loss, leaves = step(lambda p: models.loss(p, tokens, targets, CFG), full, autocast, device)
            refs[autocast] = loss, tree_map(lambda t: t.grad, leaves)
        (loss32, grads32), (loss16, grads16) = refs[False], refs[True]
        for (sp, overlap), compile in ((mode, c) for c in (None, "inductor") for mode in MODES):
            plan = plan_tp(CFG, ctx.grid, sequence_parallel=sp, overlap=overlap, compile=compile)
            truth, single = shard_params(grads32, plan), shard_params(grads16, plan)
            for autocast in (False, True):
                where = f"rank {ctx.rank} sp={sp} overlap={overlap} compile={compile} bf16={autocast}"
                loss, local = step(lambda p: parallel_loss(p, tokens, targets, plan), shard_params(full, plan),
                                   autocast, device)
                sync_grads(local, plan)
                pairs = [("loss", loss, loss32, loss16)] + [
                    (name, p.grad, e32, e16) for (name, p), (_, e32), (_, e16)
                    in zip(named_leaves(local), named_leaves(truth), named_leaves(single))]
                for name, got, e32, e16 in pairs:
                    err = rel_err(got, e32)
                    bound = 2 * rel_err(e16, e32) + 1e-6 if autocast else TOL
                    if err > bound:
                        failures.append(f"{where}: {name} {err:.2e} from the fp32 truth (bound {bound:.2e})")
    close_distributed(ctx)
    return failures


def test_tensor_parallel_overlap_on_two_gpus_equals_one_gpu():
    failures = [f for rank in spawn(worker, 2, timeout_s=600) for f in rank]
    assert not failures, "\n".join(failures)
