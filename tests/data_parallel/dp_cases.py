"""The data-parallel tests' shared case (``test_data_parallel.py`` and the tests that compare their runs the same way):
a 3-block GPT-2 with dropout, its batches, the one-process reference on the whole batch, a data-parallel trainer of
it, and how a run's reduced gradients are spied on and its steps held to the reference's (``assert_steps_match``)."""
from __future__ import annotations

import torch

from nanotrain.core.models import init_params, loss as lm_loss, preset
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.core.tree import Tree, named_leaves, tree_map
from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.trainer import data_parallel_trainer
from tests.conftest import U32, adam_bounds, adam_moments_apart, chain_rtol

CFG = preset("tiny", n_layer=3, vocab_size=512, embd_pdrop=0.1, resid_pdrop=0.1, attn_pdrop=0.1)
ADAM = AdamConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CPU32 = OffloadConfig(device="cpu", dtype=torch.float32, offload=True, state_bits=32)
BATCH, MICRO, SEQ, STEPS = 12, 2, 16, 3
# a loss of the same weights and micro-batches as one process: each rank divides by its own target count and sums
# its micro-batches in fp32, the group sums in float64 and divides by the whole count: the micro-batches' sum and
# 2 roundings (see test_data_parallel_equals_one_process)
SAME_LOSS_RTOL = chain_rtol([BATCH // MICRO]) + 2 * U32
TCFG = TrainConfig(batch=BATCH, micro_batch=MICRO, recompute="every")


def batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
        y = x.roll(-1, dims=1)
        y[:, -3:] = -100
        y[1, :7] = -100  # ranks see different target counts
        out.append((x, y))
    return out


VAL = batches(seed=1)[0]


def buckets(trainer) -> list:
    """The buckets ``spied``'s gradients are named by (ZeRO-3's weights', the others' optimizer's)."""
    return trainer.inner.weights.buckets if trainer.dcfg.zero == 3 else trainer.opt.buckets


def spied(trainer, grads: list[list]):
    """``trainer`` (data-parallel), its inner AdamW's every reduced gradient (clipped where it clips) appended to
    ``grads[-1]`` as (bucket, tensor): the caller appends a list before each step."""
    opt = trainer.opt if trainer.dcfg.zero == 3 else trainer.opt.inner  # the AdamW that receives them
    ready = opt.update
    opt.update = lambda b, reduced: (grads[-1].append((b.name, reduced.clone())), ready(b, reduced))
    return trainer


def make_dp(dcfg: DPConfig):
    import torch.distributed as dist
    return data_parallel_trainer(CFG, init_params(CFG, seed=1), TCFG, ADAM, CPU32, dcfg, dist.group.WORLD)


def single_process() -> dict:
    """The reference: one ResidentTrainer on the whole batch."""
    torch.set_num_threads(1)
    trainer = ResidentTrainer(CFG, init_params(CFG, seed=1), TCFG, ADAM, CPU32)
    data = batches()
    evals = [trainer.eval_loss(*VAL)]
    losses = [trainer.step(*data[0]).loss]
    grads = [{p: t.clone() for p, t in trainer.weights.accum.items()}]  # each step's, as its AdamW applied them
    first = {k: v.clone() for k, v in trainer.state_dict().items()}
    results = []
    for x, y in data[1:]:
        results.append(trainer.step(x, y))
        grads.append({p: t.clone() for p, t in trainer.weights.accum.items()})
    losses += [r.loss for r in results]
    assert all(r.forward_s > 0 and r.backward_s > 0 and r.optimizer_s > 0 for r in results)  # the time split
    evals.append(trainer.eval_loss(*VAL))
    state = {k: v.clone() for k, v in trainer.state_dict().items()}
    final = tree_map(lambda t: t.detach().clone().requires_grad_(), trainer.master_params())
    lm_loss(final, *VAL, CFG).backward()  # the validation loss's gradient there: what a move of the weights does
    trainer.close()
    return {"losses": losses, "evals": evals, "grads": grads, "first_state": first, "state": state,
            "val_grads": {path: t.grad for path, t in named_leaves(final)}}


def reduced_grads(per_rank: list[dict], zero: int, step: int = 0) -> dict[str, torch.Tensor]:
    """Per parameter, from what rank 0's (DDP: whole buckets) or every rank's (ZeRO: shards) optimizer received at
    ``step``."""
    out = {}
    for b in per_rank[0]["buckets"]:
        out.update(b.views(torch.cat([dict(r["grads"][step])[b.name] for r in (per_rank if zero else per_rank[:1])])))
    return out


def assert_steps_match(runs: list[dict], grads: list[dict], reference: dict, what: str,
                       start: Tree | None = None) -> None:
    """Every rank's losses and validation losses (where taken), and rank 0's state, against the reference's, from
    the gradients each side applied (``grads``: ours by path, each step) to the weights both began from (``start``,
    ``CFG``'s by default; its leaves AdamW trains: those with gradients): the first loss and validation as the test
    says; each master and moment within what AdamW makes of them (``conftest.adam_bounds``, ``adam_moments_apart``),
    each later loss within the first's bound plus what that distance moves it (the validation after the last step:
    its own gradient there times that distance, to first order)."""
    trained = reference["grads"][0]  # a LoRA spec's frozen base has none
    w0 = {p: t for p, t in named_leaves(init_params(CFG, seed=1) if start is None else start) if p in trained}
    aparts, moved = adam_bounds(w0, grads, reference["grads"], ADAM)
    moved_val = sum(float((reference["val_grads"][p].double().abs().reshape(-1) * a[-1]).sum())
                    for p, a in aparts.items()) if "val_grads" in reference else None
    first = SAME_LOSS_RTOL
    for rank, r in enumerate(runs):
        for s, (a, b) in enumerate(zip(r["losses"], reference["losses"], strict=True)):
            assert abs(a - b) <= first * abs(b) + moved[s], (what, rank, s, r["losses"], reference["losses"])
        evals = zip(r["evals"], reference["evals"], strict=True) if "evals" in r else ()  # where this run took them
        for (a, b), m in zip(evals, (0.0, moved_val)):
            assert abs(a - b) <= first * abs(b) + m, (what, rank, r["evals"], reference["evals"])
    ours, ref = runs[0]["state"], reference["state"]
    assert set(ours) == set(ref) and all(int(ours[k]) == int(ref[k]) for k in ("steps", "skipped_steps")), what
    for path, a in aparts.items():
        dm, dv = adam_moments_apart([g[path].reshape(-1) for g in grads],
                                    [g[path].reshape(-1) for g in reference["grads"]], ADAM.betas)
        for key, bound in (("master", a[-1]), ("exp_avg", dm), ("exp_avg_sq", dv)):
            diff = (ours[f"{key}.{path}"] - ref[f"{key}.{path}"]).abs().reshape(-1).double()
            over = torch.where(diff == 0, 0.0, diff / bound).max()  # a moment 0 on both sides (an unused position)
            assert over <= 1, f"{what}: {key} of {path} {over:.2f} times its bound"
