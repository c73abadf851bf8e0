"""DDP and ZeRO-1/2/3 on 2 and 3 CPU processes reproduce one process on the same global batch (fp32).

Against a single-process ``ResidentTrainer`` on the whole batch (micro-batches of 2, dropout on):
every step's loss, every reduced gradient of the first step, and after 3 AdamW steps the masters and both moments:
the first loss and gradients within the bound of the sum over micro-batches (``conftest.chain_rtol``), each master
and moment within what AdamW makes of the gradients each side applied (``conftest.adam_bounds``,
``adam_moments_apart``), each later loss within that plus what that distance moves it. ZeRO-2 and ZeRO-3 runs also
resume from the single-process checkpoint taken after step 1 (resharding it) and continue with its losses;
ZeRO-3 holds at most three units' gathered weights at a time. Validation (``eval_loss``, under ZeRO-3
gathered unit by unit too) gives one process's loss before the first step and after the last. Every
rank skips a step alike when one rank's loss is not finite. A counted check shows that DDP launches
its first bucket's sum before backward has produced the last unit's gradient. One forked world per
size runs every check, to stay fast on two cores.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nanotrain.core.models import init_params, loss as lm_loss, model_spec, preset, run
from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.config import check_split
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.data_parallel import comms
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig
from nanotrain.core.tree import Tree, named_leaves, tree_map
from tests.conftest import U32, adam_bounds, adam_moments_apart, chain_rtol, rel_err

CFG = preset("tiny", n_layer=3, vocab_size=512, embd_pdrop=0.1, resid_pdrop=0.1, attn_pdrop=0.1)
ADAM = AdamConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CPU32 = OffloadConfig(device="cpu", dtype=torch.float32, offload=True, state_bits=32)
BATCH, MICRO, SEQ, STEPS = 12, 2, 16, 3
# a loss of the same weights and micro-batches as one process: each rank divides by its own target count and sums
# its micro-batches in fp32, the group sums in float64 and divides by the whole count: the micro-batches' sum and
# 2 roundings (see test_data_parallel_equals_one_process)
SAME_LOSS_RTOL = chain_rtol([BATCH // MICRO]) + 2 * U32
TCFG = TrainConfig(batch=BATCH, micro_batch=MICRO, recompute="every")
M_UNITS = model_spec(CFG).unit_dict()
RUNS = {"ddp": DPConfig(zero=0, bucket_mb=0.3, check_replicas=True), "ddp-per-unit": DPConfig(zero=0, bucket_mb=0),
        "zero1": DPConfig(zero=1, bucket_mb=0.3), "zero2": DPConfig(zero=2, bucket_mb=0), "zero3": DPConfig(zero=3),
        "zero3-kept": DPConfig(zero=3)}
RECOMPUTE = {"zero3-kept": "none"}  # ZeRO-3 keeping every activation, its weights released under the graph


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


def run_steps(make, first_state=None) -> dict:
    """Losses, each step's reduced gradients (as handed to the inner optimizer), the final state, and the
    validation losses before the first step and after the last."""
    grads = []
    trainer = spied(make(), grads)
    data = batches()
    evals = [trainer.eval_loss(*VAL)]
    losses = [(grads.append([]), trainer.step(*data[0]).loss)[1]]
    if first_state is not None:  # restart from the single-process checkpoint after step 1
        trainer.close()
        trainer = spied(make(), grads)
        trainer.load_state_dict(first_state)
        trainer.step_count = 1
    results = [(grads.append([]), trainer.step(x, y))[1] for x, y in data[1:]]
    losses += [r.loss for r in results]
    assert all(r.forward_s > 0 and r.backward_s > 0 and r.optimizer_s > 0 for r in results)  # the time split
    evals.append(trainer.eval_loss(*VAL))
    state = {k: v.clone() for k, v in trainer.state_dict().items()}
    trainer.close()
    return {"losses": losses, "evals": evals, "grads": grads, "state": state, "buckets": buckets(trainer)}


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


def counted(dcfg: DPConfig) -> list[tuple[str, str]]:
    """The order of bucket launches and units' final gradients over one step."""
    events = []
    real = comms.sum_async
    comms.sum_async = lambda flat, group: (events.append(("launch", str(flat.numel()))), real(flat, group))[1]
    trainer = make_dp(dcfg)
    ready = trainer.opt.update
    trainer.opt.update = lambda unit, gs: (events.append(("ready", unit)), ready(unit, gs))
    trainer.step(*batches()[0])
    comms.sum_async = real
    trainer.close()
    return events


def skips_together(dcfg: DPConfig, bad_rank: int) -> dict:
    """A non-finite loss on one rank only: every rank skips the step, and the weights stay as they were."""
    import torch.distributed as dist
    trainer = make_dp(dcfg)
    data = batches()
    trainer.step(*data[0])
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    real = run.head_loss
    if dist.get_rank() == bad_rank:
        run.head_loss = lambda *a, **k: real(*a, **k) * float("nan")
    skipped = trainer.step(*data[1]).skipped
    run.head_loss = real
    after = {k: v.clone() for k, v in trainer.state_dict().items()}
    counts = (trainer.opt.steps, trainer.opt.skipped_steps)
    resumed = not trainer.step(*data[2]).skipped
    trainer.close()
    same = all(torch.equal(before[k], after[k]) for k in before if k.startswith("master"))
    return {"skipped": skipped, "counts": counts, "unchanged": same, "resumed": resumed}


def gathered_units() -> list[tuple[int, int]]:
    """ZeRO-3: the most units' weights held gathered at once during a step, and how many after it; the same for
    a validation after it."""
    trainer = make_dp(RUNS["zero3"])
    engine, peak = trainer.inner.weights, [0]
    gather = engine.gather

    def counting(k, ahead):
        tree = gather(k, ahead)
        peak.append(len(engine.held()))
        return tree

    engine.gather = counting
    out = []
    for run_once in (lambda: trainer.step(*batches()[0]), lambda: trainer.eval_loss(*VAL)):
        peak[:] = [0]
        run_once()
        out.append((max(peak), len(engine.held())))
    trainer.close()
    return out


def make_dp(dcfg: DPConfig):
    import torch.distributed as dist
    return data_parallel_trainer(CFG, init_params(CFG, seed=1), TCFG, ADAM, CPU32, dcfg, dist.group.WORLD)


def master_bytes(dcfg: DPConfig) -> tuple[int, int]:
    """(bytes of the storages behind this rank's fp32 masters, 4 bytes a parameter of the whole model)."""
    trainer = make_dp(dcfg)
    units = trainer.opt.inner.inner._units.values()
    storages = {m.untyped_storage().data_ptr(): m.untyped_storage().nbytes() for u in units for m in u.master}
    whole = 4 * model_spec(CFG).costs.total_params
    trainer.close()
    return sum(storages.values()), whole


def worker(reference_state: dict) -> dict:
    torch.set_num_threads(1)
    ctx = init_distributed(GridConfig(dp=launched_world_size()), "gloo", timeout_s=60)
    out = {}
    with ctx.guard():
        for name, dcfg in RUNS.items():
            ctx.where = name
            tcfg = replace(TCFG, recompute=RECOMPUTE.get(name, TCFG.recompute))
            out[name] = run_steps(lambda: data_parallel_trainer(CFG, init_params(CFG, seed=1 + ctx.rank), tcfg, ADAM,
                                                                CPU32, dcfg, ctx.grid.dp_group))
        ctx.where = "resume"
        out["zero2-resumed"] = run_steps(lambda: make_dp(RUNS["zero2"]), reference_state)
        out["zero3-resumed"] = run_steps(lambda: make_dp(RUNS["zero3"]), reference_state)
        out["gathered"] = gathered_units()
        ctx.where = "skip"
        out["skip"] = [skips_together(RUNS[name], ctx.world_size - 1) for name in ("ddp-per-unit", "zero2", "zero3")]
        ctx.where = "bf16"
        out["bf16"] = run_steps(lambda: make_dp(DPConfig(zero=1, reduce_dtype=torch.bfloat16)))["losses"]
        ctx.where = "counted"
        out["events"] = counted(RUNS["ddp-per-unit"])
        ctx.where = "master bytes"
        out["master_bytes"] = master_bytes(DPConfig(zero=1))
    close_distributed(ctx)
    return out


@pytest.fixture(scope="module")
def reference() -> dict:
    return single_process()


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


@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_equals_one_process(world, reference):
    per_rank = spawn(worker, world, (reference["first_state"],), start_method="fork", timeout_s=120)
    for name, dcfg in RUNS.items():
        # The first loss and validation run the same weights and micro-batches as one process; only the sum
        # differs: each rank divides by its own target count and sums its micro-batches in fp32, the group sums in
        # float64 and divides by the whole count: the 6 micro-batches' sum (conftest.chain_rtol) and 2 roundings.
        # After a step the weights differ as AdamW makes them (assert_steps_match).
        runs = [r[name] for r in per_rank]
        grads = [reduced_grads(runs, dcfg.zero, s) for s in range(STEPS)]
        assert set(grads[0]) == set(reference["grads"][0]), name
        for path, g in grads[0].items():  # each micro-batch's gradient the same kernels' on every side: only the sum
            # of the 6 reorders (ranks first, or reduce-scatters per micro-batch), 2.9e-7 (conftest.chain_rtol)
            err = rel_err(g, reference["grads"][0][path])
            assert err <= chain_rtol([BATCH // MICRO]), (name, path, err)
        assert_steps_match(runs, grads, reference, name)
        if dcfg.zero:
            assert all(r[name]["state"] == {} for r in per_rank[1:]), name  # gathered on the first rank only
    for name in ("zero2-resumed", "zero3-resumed"):  # from the reference's state after its first step
        resumed, zero = per_rank[0][name], RUNS[name.removesuffix("-resumed")].zero
        grads = [reference["grads"][0]] + [reduced_grads([r[name] for r in per_rank], zero, s) for s in (1, 2)]
        resumed = {**resumed, "losses": reference["losses"][:1] + resumed["losses"][1:],
                   "evals": reference["evals"][:1] + resumed["evals"][1:]}  # before the restart: not this run's
        assert_steps_match([resumed], grads, reference, name)
    # At most the head's two units and the next block are held gathered, and nothing between steps; validation too.
    assert all(r["gathered"] == [(3, 0), (3, 0)] for r in per_rank), [r["gathered"] for r in per_rank]
    for r in per_rank:
        assert r["skip"] == [{"skipped": True, "counts": (1, 1), "unchanged": True, "resumed": True}] * 3, r["skip"]
        # bf16 sums move the weights by ~1e-3 relative; the losses barely.
        assert all(abs(a - b) <= 1e-4 * b for a, b in zip(r["bf16"], reference["losses"])), r["bf16"]
        assert r["bf16"][1:] != reference["losses"][1:]
    for r in per_rank:  # ZeRO masters are 1/N of the model (padding aside), not views of whole buckets
        held, whole = r["master_bytes"]
        assert held <= whole / world + 4 * 64 * world, (held, whole)
    events = per_rank[0]["events"]
    launches = [i for i, (kind, _) in enumerate(events) if kind == "launch"]
    readies = [i for i, (kind, _) in enumerate(events) if kind == "ready"]
    assert len(launches) == len(M_UNITS) and len(readies) == len(M_UNITS)  # one sum per bucket, last micro-batch only
    assert launches[0] < readies[-1] and launches[-2] < readies[-1], events  # during backward, not after it


def test_batch_that_does_not_split_names_a_fix():
    with pytest.raises(ValueError, match=r"batch 10 does not split over 3 data-parallel ranks in micro-batches of 2: "
                                         r"it must be a multiple of 3 x 2 = 6; use a batch of 12$"):
        check_split(10, 2, 3)
    with pytest.raises(ValueError, match=r"multiple of 2 x 4 = 8; use a batch of 16 or a micro-batch of 1, 2, 3, 6"):
        check_split(12, 4, 2)
