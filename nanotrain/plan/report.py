"""The plan as a person reads it before a run: what goes where, how fast on which GPU, both peaks, the disk.

``tasks.plan`` prints it without a GPU; ``tasks.finetune`` prints the same before it loads anything. Every
number is the planners' (``stream_plan``, ``stream_search``, ``plan``) and every assumption is stated in it:
the GPU's datasheet peak and link, the sustained rate the step-time model was fitted at, the allocator's
setting and the margin it costs.
"""
from __future__ import annotations

from dataclasses import dataclass

from nanotrain.core.flops import mfu
from nanotrain.checkpoint.slices import disk_parts
from nanotrain.core.footprint import gib_parts, margin
from nanotrain.core.machine import GIB
from nanotrain.core.lora_footprint import adapter_params, frozen_bytes
from nanotrain.core.models import model_spec
from nanotrain.core.models.lora import rank
from nanotrain.plan.candidates import Ask, Box
from nanotrain.plan.plan import Plan
from nanotrain.stream.footprint import StreamJob
from nanotrain.stream.search import RankedPlan, StreamCosts, predict


@dataclass(frozen=True)
class Machine:
    """What the prediction assumes: a named GPU's datasheet, or this machine's measured link."""
    name: str
    costs: StreamCosts
    peak_flops: float | None   # for MFU; None: unknown card

    def describe(self) -> str:
        peak = f"bf16 peak {self.peak_flops / 1e12:.0f} TFLOP/s dense, " if self.peak_flops else ""
        return (f"GPU: {self.name} as assumed ({peak}{self.costs.flops / 1e12:.0f} TFLOP/s sustained by compiled "
                f"blocks, host link {self.costs.link_bytes_s / 1e9:.1f} GB/s each way)")


def _disk(job: StreamJob) -> str:
    """A checkpoint on disk, as ``nanotrain.checkpoint`` writes it (every rank's shards together)."""
    disk = disk_parts(job.spec, job.moment_bytes)
    return f"  a checkpoint on disk: {sum(b for _, b in disk) / GIB:.2f} GiB ({gib_parts(disk)})"


def _table(job: StreamJob, label: str, gpu_cap: int, host: str, machine: Machine, allocator: str,
           *lines: str, ranks: int = 1) -> str:
    """A plan's ``lines`` under what it is asked (the job, the caps, its ``ranks``), the GPU and the allocator; then
    the disk."""
    rows = f"{job.batch * job.shards}" + (f" ({job.batch} a rank)" if job.shards > 1 else "")
    return "\n".join([
        f"plan for {label} ({job.spec.costs.total_params / 1e9:.2f}B parameters) at batch {rows} x {job.seq}, "
        f"{job.state_bits}-bit moments, {job.dtype_bytes}-byte compute, GPU cap {gpu_cap / GIB:.1f} GiB, {host}",
        f"  {machine.describe()}",
        f"  {allocator}; plans keep {margin(gpu_cap, job.expandable, ranks) / GIB:.2f} GiB of the cap free beside "
        f"their allocated peak", *lines, _disk(job)])


def _speed(job: StreamJob, step_s: float, machine: Machine, gpus: int = 1) -> str:
    """The run's speed over its ``gpus``: every rank's rows (a streamed job's are one rank's of ``job.shards``)."""
    seqs = job.batch * job.shards
    tokens = seqs * job.seq / step_s
    share = mfu(tokens, job.spec, job.seq, machine.peak_flops and machine.peak_flops * gpus)
    return f"{seqs / step_s:.2f} seq/s, {tokens / 1e3:.2f}k tokens/s" + (f", MFU {share:.1%}" if share else "")


def stream_table(ranked: RankedPlan, machine: Machine, gpu_cap: int, host: str, allocator: str,
                 label: str) -> str:
    """The streamed plan ``ranked`` (``stream_search.search_streaming``'s pick) as the lines a run prints."""
    plan, job = ranked.plan, ranked.plan.job
    c = plan.choice
    tail = f", {c.tail}-block tail in passes of {c.tail_micro_batch or c.micro_batch}" if c.tail else ", no tail"
    ends = "embedding and head staged" if c.staged_ends else "embedding and head in their slots"
    end = f", then {ranked.end_s:.2f} after it" if ranked.end_s else ""
    return _table(
        job, label, gpu_cap, host, machine, allocator,
        f"  streamed: micro-batch {c.micro_batch}, {c.on_host} of {job.spec.n_layer - c.tail} block inputs in host "
        f"memory{tail}, {ends}, LM-head loss in chunks of {job.chunk} tokens",
        f"  step {ranked.step_s:.2f} s predicted (forward {ranked.forward_s:.2f}, head and tail {ranked.top_s:.2f}, "
        f"backward {ranked.backward_s:.2f} bound by {'the host link' if ranked.link_bound else 'compute'}{end}): "
        f"{_speed(job, ranked.step_s, machine, job.shards)}",
        f"  GPU peak {plan.device_bytes / GIB:.2f} GiB in the {plan.phase}: {gib_parts(plan.device)}",
        f"  host peak {plan.host_bytes / GIB:.2f} GiB: {gib_parts(plan.host)}; while loading "
        f"{plan.load_bytes / GIB:.2f}", ranks=job.shards)


def engine_table(job: StreamJob, plan: Plan, machine: Machine, gpu_cap: int, host: str, allocator: str,
                 label: str) -> str:
    """A resident, data-parallel or 3D plan as the lines a run prints: the engine's own footprint, the predicted
    step (compute, or the host's AdamW with masters and moments in host memory; the exposed collectives)."""
    d = plan.detail
    if plan.engine == "streamed":  # an adapted spec's: its bytes are the adapters' (``core.lora_footprint``)
        held = (f"{plan.gpu_bytes / GIB:.2f} GiB on the GPU, micro-batch {plan.micro_batch}, {d.on_host} block inputs "
                f"in host memory, the step timed with the base frozen (input gradients alone, the base streamed as "
                f"stored)")
    elif plan.engine == "3d":
        held = (f"{plan.gpu_bytes / GIB:.2f} GiB per GPU; compute {d.compute_s:.3f} s, collectives and sends "
                f"{d.comm_s:.3f} s, data-parallel traffic exposed {d.dp_s:.3f} s, bubble {d.bubble:.1%}")
    else:
        held = d.describe()
    where = "" if plan.engine == "data-parallel" else f" ({plan.layout()})"  # ZeroPlan says its own
    peak = f"{plan.host_bytes / GIB:.2f} GiB"
    if plan.engine == "streamed":  # an adapted spec's host bytes by class, and the load's (``plan.candidates``)
        peak += f": {gib_parts(d.host)}; while loading {d.load_bytes / GIB:.2f}"
    elif plan.host_detail:
        peak += f" ({plan.host_detail})"
    return _table(job, label, gpu_cap, host, machine, allocator,
                  f"  {plan.engine}{where}: {held}; masters and moments on the {plan.states}, recompute "
                  f"{plan.recompute}",
                  f"  step {plan.step_s:.2f} s predicted: {_speed(job, plan.step_s, machine, plan.world)}",
                  f"  host peak of each process {peak}", f"  flags: {plan.flags()}", ranks=plan.world)


def plan_table(plan: Plan, ask: Ask, box: Box, machine: Machine, allocator: str, label: str) -> str:
    """The table of the search's pick, as ``tasks.plan`` and ``tasks.finetune`` print it: a streamed plan's by byte
    class and phase (its job is each rank's), any other's by its engine's footprint (the whole batch)."""
    streamed = plan.engine == "streamed"
    spec = model_spec(ask.cfg)
    if ask.lora:
        label += (f" with LoRA rank {rank(spec)} on {','.join(a.target for a in spec.adapters)} "
                  f"({adapter_params(spec) / 1e6:.1f}M trained parameters, the frozen base in "
                  f"{'NF4' if ask.base_bits == 4 else f'{ask.dtype_bytes}-byte compute'}, "
                  f"{frozen_bytes(spec, ask.dtype_bytes, ask.base_bits) / GIB:.2f} GiB)")
    job = StreamJob(ask.cfg, ask.batch // plan.dp if streamed else ask.batch, ask.seq, ask.adam_bits,
                    dtype_bytes=ask.dtype_bytes, shards=plan.dp if streamed else 1, deferred=ask.deferred,
                    base_rss=box.base_rss, expandable=box.expandable)
    if box.host_cap is not None:
        host = f"host cap {box.host_cap / GIB:.1f} GiB"
    elif box.node_host is not None:  # the search's share (``search.on``)
        host = (f"no host cap (the host's {box.node_host / GIB:.1f} GiB available, "
                f"{box.node_host // plan.world / GIB:.1f} a process)")
    else:
        host = "no host cap"
    if streamed and not ask.lora:
        table = stream_table(predict(plan.detail, box.costs), machine, box.gpu_cap, host, allocator, label)
    else:
        table = engine_table(job, plan, machine, box.gpu_cap, host, allocator, label)
    return table + _background(job, plan, box.host_cap)


def _background(job: StreamJob, plan: Plan, host_cap: int | None) -> str:
    """Whether a save can be written on a thread (``checkpoint.background``): it copies a process's share of the
    checkpoint to host memory beside the plan's host peak, or is written at once where the cap has not that room."""
    share = sum(b for _, b in disk_parts(job.spec, job.moment_bytes))
    if plan.zero or plan.tp > 1 or plan.pp > 1:  # each rank writes its shard; DDP's first rank writes the whole
        share //= plan.world
    need = plan.host_bytes + share
    verdict = ("" if host_cap is None else ", within the host cap" if need <= host_cap else
               ": over the host cap, so each save is written at once, training waiting for it")
    return (f"\n  saves in the background: a host copy of {share / GIB:.2f} GiB a process beside its peak, "
            f"{need / GIB:.2f} GiB{verdict}")
