"""DDP and ZeRO-1/2/3 on 2 and 3 CPU processes reproduce one process on the same global batch (fp32).

Against a single-process ``ResidentTrainer`` on the whole batch (micro-batches of 2, dropout on):
every step's loss, every reduced gradient of the first step, and after 3 AdamW steps the masters and both moments:
the first loss and gradients within the bound of the sum over micro-batches (``conftest.chain_rtol``), each master
and moment within what AdamW makes of the gradients each side applied (``conftest.adam_bounds``,
``adam_moments_apart``), each later loss within that plus what that distance moves it. ZeRO-2 and ZeRO-3 runs also
resume from the single-process checkpoint taken after step 1 (resharding it) and continue with its losses;
ZeRO-3 holds at most three units' gathered weights at a time; holding them all through the step (``hold``) changes
no bit of its state. Validation (``eval_loss``, under ZeRO-3
gathered unit by unit too) gives one process's loss before the first step and after the last. Every
rank skips a step alike when one rank's loss is not finite. A counted check shows that DDP launches
its first bucket's sum before backward has produced the last unit's gradient. One forked world per
size runs every check, to stay fast on two cores.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nanotrain.core.models import init_params, model_spec, run
from nanotrain.data_parallel import DPConfig
from nanotrain.data_parallel.config import check_split
from nanotrain.data_parallel.trainer import data_parallel_trainer
from nanotrain.data_parallel import comms
from nanotrain.distributed import GridConfig, close_distributed, init_distributed, launched_world_size, spawn
from tests.conftest import chain_rtol, rel_err
from tests.data_parallel.dp_cases import (ADAM, BATCH, CFG, CPU32, MICRO, STEPS, TCFG, VAL, assert_steps_match, batches,
                                          buckets, make_dp, reduced_grads, single_process, spied)

M_UNITS = model_spec(CFG).unit_dict()
RUNS = {"ddp": DPConfig(zero=0, bucket_mb=0.3, check_replicas=True), "ddp-per-unit": DPConfig(zero=0, bucket_mb=0),
        "zero1": DPConfig(zero=1, bucket_mb=0.3), "zero2": DPConfig(zero=2, bucket_mb=0), "zero3": DPConfig(zero=3),
        "zero3-kept": DPConfig(zero=3), "zero3-held": DPConfig(zero=3, hold=True)}
# ZeRO-3 keeping every activation, its weights released under the graph; and its weights held through the step
RECOMPUTE = {"zero3-kept": "none", "zero3-held": "none"}


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


def gathered_units(dcfg: DPConfig) -> list[tuple[int, int]]:
    """ZeRO-3: the most units' weights held gathered at once during a step, and how many after it; the same for
    a validation after it."""
    trainer = make_dp(dcfg)
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
        out["zero3-held-resumed"] = run_steps(lambda: make_dp(RUNS["zero3-held"]), reference_state)
        out["gathered"] = gathered_units(RUNS["zero3"]), gathered_units(RUNS["zero3-held"])
        ctx.where = "skip"
        out["skip"] = [skips_together(RUNS[name], ctx.world_size - 1) for name in ("ddp-per-unit", "zero2", "zero3")]
        ctx.where = "bf16"
        out["bf16"] = run_steps(lambda: make_dp(DPConfig(zero=1, reduce_dtype=torch.bfloat16)))
        ctx.where = "counted"
        out["events"] = counted(RUNS["ddp-per-unit"])
        ctx.where = "master bytes"
        out["master_bytes"] = master_bytes(DPConfig(zero=1))
    close_distributed(ctx)
    return out


@pytest.fixture(scope="module")
def reference() -> dict:
    return single_process()


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
    for r in per_rank:  # holding the gathered weights moves no value: the same sums in the same order, bit for bit
        assert all(torch.equal(r["zero3-held"]["state"][k], v) for k, v in r["zero3-kept"]["state"].items())
        assert r["zero3-held"]["losses"] == r["zero3-kept"]["losses"]
    for name in ("zero2-resumed", "zero3-resumed", "zero3-held-resumed"):  # from the reference's state after step 1
        resumed, zero = per_rank[0][name], RUNS[name.removesuffix("-resumed")].zero
        grads = [reference["grads"][0]] + [reduced_grads([r[name] for r in per_rank], zero, s) for s in (1, 2)]
        resumed = {**resumed, "losses": reference["losses"][:1] + resumed["losses"][1:],
                   "evals": reference["evals"][:1] + resumed["evals"][1:]}  # before the restart: not this run's
        assert_steps_match([resumed], grads, reference, name)
    # At most the head's two units and the next block are held gathered, and nothing between steps; validation too.
    # Held, every unit (5: the embeddings, 3 blocks, the head), all the time.
    gathered = [r["gathered"] for r in per_rank]
    assert all(g == ([(3, 0), (3, 0)], [(5, 5), (5, 5)]) for g in gathered), gathered
    # bf16 sums (ZeRO-1): the gradients each side applied, whatever bf16 made of them, bound the rest as above
    bf16 = [r["bf16"] for r in per_rank]
    assert_steps_match(bf16, [reduced_grads(bf16, 1, s) for s in range(STEPS)], reference, "bf16")
    for r in per_rank:
        assert r["skip"] == [{"skipped": True, "counts": (1, 1), "unchanged": True, "resumed": True}] * 3, r["skip"]
        assert r["bf16"]["losses"][1:] != reference["losses"][1:]  # the sums were bf16's
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
