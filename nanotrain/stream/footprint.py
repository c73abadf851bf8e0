"""What weight streaming (``nanotrain.stream.trainer``) holds on the GPU and in host memory, by byte class.

Every class names a buffer of the trainer or its optimizer (``stream.optimizer``, ``stream.staged``), so the
estimate can be checked against what they allocate (``tests/stream/test_stream_plan.py`` counts them on the CPU).
The GPU peak is the trainer's buffers that live all step, plus the largest of its phases:

* head: the kept block inputs, the gradient flowing down, the head's fp32 gradients, and per pass (a tail
  pass: ``tail_micro_batch`` sequences) the tail's activations without recompute (the eager count, compiled
  blocks' too: ``UNACCOUNTED`` was fitted on compiled runs with it), the final norm's, and the LM-head loss
  (``nanotrain.core.loss``): a chunk's logits, and [vocab, width] terms: the padded weight copy (unless the
  vocabulary is aligned), the fp32 gradient it sums and each chunk's addend, and in its backward that sum,
  scaled in place, and its cast; then the tail's backward, whose weight gradients autograd returns all at
  once, beside the head weight's;
* a block's backward: its recompute from the kept input, the gradients of its widest activations and its
  weight gradients in the compute dtype (``core.footprint.recompute_bytes``, as the resident trainer's recompute);
* the embedding's backward: its fp32 gradients and one dense gradient in the compute dtype.

(The forward holds the same buffers less the head's gradients and the gradient flowing down, and smaller
temporaries than a recompute with autograd: never the peak.) What this does not count, the plan keeps
free: ``core.footprint.margin``, every engine's, for cuBLAS workspaces, compiled kernels' scratch, the
allocator's rounding, and its fragmentation, which ``core.machine.use_expandable_segments`` all but removes (2.2 GiB
of a 24 GiB cap was reserved but unallocated without it: it then keeps a wider margin).

Host memory is the optimizer's locked arenas (fp32 masters and moments per unit: the weights computed with
are never kept there), the block inputs kept in host memory, the gradients a deferred step keeps, CUDA's
libraries and the process before loading; its peak is the larger of training and loading (each leaf is read as
the optimizer takes it into its arenas and let go of once its master is written: ``StreamJob.load_peak``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from nanotrain.stream.pinned import PAGE, HostArena
from nanotrain.core.footprint import (COMPILE_HOST_BYTES, MOMENT_BLOCK, backward_temps, fits, leaf_moment_bytes,
                                      logits_vocab, recompute_bytes)
from nanotrain.core.machine import CUDA_RUNTIME_BYTES
from nanotrain.core.leaves import in_flight, load_peak
from nanotrain.core.models import model_spec
from nanotrain.core.models.spec import ModelSpec, Unit

# The streamed optimizer's defaults (``optim.units.OffloadConfig``; optim/ sits above core/).
STAGE_NUMEL = 1 << 23
# What the classes do not explain, in units of the tail's weights in the compute dtype: the plans with a tail peaked
# above the count by about their tail's weights once more, the plans without one within 2.4% of it (allocated,
# measured / counted): a GPT-2-shaped 6.6B, 32 blocks of 4096, micro-batch 16, a 6-block tail in passes of 2 (H100)
# 22.68 / 20.51 GiB; llama-3.1-8b, micro-batch 16, a 3-block tail in passes of 4 (H100) 21.73 / 20.78; without a
# tail, llama-3.1-8b at micro-batch 16 13.89 / 13.56, gpt2-xl at 8 8.92 / 9.10, qwen2.5-32b at 16 over 4 GPUs 42.92 /
# 43.58 (H200; all compiled, 8-bit moments, torch 2.11). It was 10.6% of every count, fitted to the first alone: 12%
# high without a tail. Until a measurement splits it by phase, it is this.
UNACCOUNTED = 1.0


@dataclass(frozen=True)
class StreamJob:
    """What a streamed run is asked to do; a plan (``StreamChoice``) decides the rest."""
    cfg: Any                    # any family's config, or its spec
    batch: int                  # this process's sequences per step
    seq: int
    state_bits: int             # 8 or 32
    dtype_bytes: int = 2
    shards: int = 1             # data-parallel ranks sharing the optimizer state
    deferred: bool = False      # clipping or fp16: the blocks' gradients wait in host memory
    base_rss: int = 0           # the process before loading: Python, torch, the data
    expandable: bool = True     # the CUDA allocator's expandable segments are on
    stage_numel: int = STAGE_NUMEL  # elements of a staged unit's chunk
    compiled: bool = False      # the block, its trunk and the fp32 accumulation compiled (``stream.trainer``)

    @property
    def compiling(self) -> int:
        """What inductor keeps in host memory of the three functions the streamed trainer compiles."""
        return 3 * COMPILE_HOST_BYTES if self.compiled else 0

    @property
    def stage_bytes(self) -> int:
        """Two staging buffers of a chunk's masters and fp32 moments (``stream.staged``)."""
        return 2 * (max(MOMENT_BLOCK, self.stage_numel // MOMENT_BLOCK * MOMENT_BLOCK) * 12 + 64)

    @cached_property
    def spec(self) -> ModelSpec:
        return model_spec(self.cfg)

    def numel(self, path: str) -> int:
        return math.prod(self.spec.leaf(path).shape)

    def moment_bytes(self, path: str) -> int:
        """A leaf's moments as ``OffloadConfig.moment_bits`` keeps them: 8-bit codes and a scale per block, or
        fp32 (small leaves and ``spec.fp32_moments``)."""
        return leaf_moment_bytes(self.spec, path, self.state_bits)

    def params(self, unit: Unit) -> int:
        return self._units[unit.name][0]

    def state(self, unit: Unit) -> int:
        """A unit's masters and moments (one rank's share)."""
        return self._units[unit.name][1]

    def arena(self, unit: Unit) -> int:
        """The unit's locked host arena as ``StreamedAdam`` carves it (masters, then each leaf's moment
        tensors, aligned), with its page of slack."""
        return self._units[unit.name][2]

    @cached_property
    def arenas(self) -> int:
        """Every unit's host arena together: the masters and moments in host memory (one rank's share)."""
        return sum(arena for *_, arena in self._units.values())

    @cached_property
    def _units(self) -> dict[str, tuple[int, int, int]]:
        """Unit name -> (parameters, masters and moments, host arena), counted once per job."""
        out = {}
        for unit in self.spec.units:
            numels = [self.numel(p) for p in unit.paths]
            sizes = [(n, torch.float32) for n in numels]
            for p, n in zip(unit.paths, numels):
                eight = self.moment_bytes(p) < 8 * n
                sizes += [(n, torch.uint8), (-(-n // MOMENT_BLOCK), torch.float32)] * 2 if eight else \
                    [(n, torch.float32)] * 2
            state = sum(4 * n + self.moment_bytes(p) for p, n in zip(unit.paths, numels)) // self.shards
            out[unit.name] = (sum(numels), state, HostArena.size_of(sizes) // self.shards + PAGE)
        return out

    def slot(self, unit: Unit, staged: bool = False) -> int:
        """A device slot for ``unit``: its masters and moments (none when staged) and its weights."""
        return (0 if staged else self.state(unit)) + self.params(unit) * self.dtype_bytes

    @property
    def chunk(self) -> int:
        """Tokens per chunk of the LM-head loss (``logits_chunk``; the run's ``StreamConfig.chunk_tokens``)."""
        return logits_chunk(self.spec)

    @cached_property
    def load_peak(self) -> int:
        """Host memory while the optimizer takes the leaves in, unit by unit (``core.leaves.load_peak``): the arenas
        filled so far, and a leaf in flight, read in the compute dtype (a random model's, most checkpoints'; a resumed
        run's fp32 masters are twice that). Measured on the CPU (175M parameters) when the optimizer took a whole fp32
        tree instead (the peak then the arenas'): 8.30 bytes a parameter with 8-bit moments against 8.26 counted,
        12.02 against 12.00 with 32-bit ones."""
        units = ((self.arena(u), max(in_flight(self.numel(p), self.dtype_bytes) for p in u.paths))
                 for u in self.spec.units)
        return load_peak(units) + CUDA_RUNTIME_BYTES + self.base_rss

    @property
    def boundary(self) -> int:
        """One block input of the whole batch."""
        return self.batch * self.seq * self.spec.costs.width * self.dtype_bytes


@dataclass(frozen=True)
class StreamChoice:
    """What the plan decides (``StreamConfig``'s micro_batch, on_host, tail, tail_micro_batch; staged ends:
    ``OffloadConfig.staged_units`` names the embedding and head units)."""
    micro_batch: int
    on_host: int = 0
    tail: int = 0
    tail_micro_batch: int | None = None
    staged_ends: bool = False


@dataclass(frozen=True)
class StreamPlan:
    job: StreamJob = field(repr=False)
    choice: StreamChoice
    device: tuple[tuple[str, int], ...]  # the step-long buffers, then the peak phase's
    phase: str                           # the phase that makes the peak
    host: tuple[tuple[str, int], ...]    # training's host memory (the load's peak is ``load_bytes``)
    load_bytes: int

    @property
    def device_bytes(self) -> int:
        return sum(b for _, b in self.device)

    @property
    def host_bytes(self) -> int:
        return max(sum(b for _, b in self.host), self.load_bytes)

    @property
    def micro_batch(self) -> int:
        return self.choice.micro_batch

    @property
    def on_host(self) -> int:
        return self.choice.on_host

    def fits(self, gpu_cap: int, host_cap: int | None) -> bool:
        return (fits(self.device_bytes, gpu_cap, self.job.expandable, self.job.shards)
                and (host_cap is None or self.host_bytes <= host_cap))


def _per_token(job: StreamJob, per_token_at_2_bytes: float, tokens: int) -> int:
    return int(per_token_at_2_bytes * tokens * job.dtype_bytes / 2)


def logits_chunk(spec: ModelSpec) -> int:
    """Tokens per chunk of the LM-head loss: 2048, or 1024 above a 64k vocabulary, where a chunk's logits,
    their gradient and its fp32 softmax (2 GiB at 2048 x 128256) would weigh on a small GPU."""
    return 2048 if spec.vocab_size <= 65536 else 1024


def _head_phase(job: StreamJob, choice: StreamChoice) -> tuple[tuple[str, int], ...]:
    """The LM head's and the tail's largest moment (see the module docstring)."""
    spec, d = job.spec, job.dtype_bytes
    costs, c = spec.costs, spec.costs.width
    tokens = (choice.tail_micro_batch or choice.micro_batch) * job.seq
    vocab = math.prod(spec.leaf(spec.head_weight).shape[:1])
    vc, vc_padded = vocab * c, logits_vocab(vocab) * c
    chunk = min(job.chunk, tokens) * vc_padded // c * (2 * d + 4)  # logits, their gradient, fp32 softmax
    copy = d * vc_padded if vc_padded != vc else 0  # the padded weight
    loss = max(copy + (4 + d) * vc_padded + chunk, (4 + d) * vc)  # forward, backward of the loss
    hidden = tokens * c * (4 + 2 * d)  # the final norm's fp32 input and its output, the gradient at it
    act = _per_token(job, costs.activation_bytes("none"), tokens)
    grads, temps = costs.block_params * d, _per_token(job, backward_temps(spec), tokens)
    t = choice.tail
    tail_back = d * vc + max(t * act, act + t * grads) + temps if t else 0
    if t * act + loss >= tail_back:
        return ("tail activations", t * act), ("final norm", hidden), ("LM-head loss", loss)
    return ("final norm", hidden), ("head weight gradient and the tail's backward", tail_back)


def estimate(job: StreamJob, choice: StreamChoice) -> StreamPlan:
    """The GPU and host bytes of one plan (the module docstring says what each class is)."""
    spec, d, b = job.spec, job.dtype_bytes, job.boundary
    costs, block = spec.costs, spec.costs.block_params
    layer_major = spec.n_layer - choice.tail
    staged = choice.staged_ends
    embed, head, first = spec.embed_unit, spec.head_unit, spec.block_units[0]
    head_grads = 4 * sum(job.numel(p) for p in spec.head_paths())
    # After the head's update only a tied weight's gradient stays (the embedding adds to it); deferred, all do.
    kept_head_grads = head_grads if job.deferred else 4 * sum(job.numel(p) for p in spec.head_paths()
                                                              if p not in head.paths)
    embed_grads = 4 * sum(job.numel(p) for p in embed.paths if p not in spec.head_paths())
    flat = job.shards > 1  # a sharded slot's update takes the unit's whole fp32 gradient laid out flat
    steady = (
        ("block slots", (2 + (choice.tail > 0)) * (job.slot(first) + 4 * block * flat)),
        ("embedding and head slots", job.slot(embed, staged) + job.slot(head, staged)
         + 4 * (job.params(embed) + job.params(head)) * flat),
        ("staging", job.stage_bytes if staged else 0),
        ("block gradient", 4 * block),
        ("tail weights and gradients", choice.tail * block * (d + 4)),
        ("host inputs' staging", min(choice.on_host, 2) * b),
    )
    kept = max(layer_major - choice.on_host, 0) * b
    micro = b * choice.micro_batch // job.batch
    work = recompute_bytes(spec, choice.micro_batch * job.seq, d)
    phases = {
        "head": (("kept block inputs", kept), ("top output and gradient", b + micro), ("head gradients", head_grads),
                 *_head_phase(job, choice)),
        "blocks' backward": (("kept block inputs", kept), ("gradient flowing down", b + micro),
                             ("head gradients", kept_head_grads), ("one block's recompute and backward", work)),
        "embedding's backward": (("gradient flowing down", b), ("head gradients", kept_head_grads),
                                 ("embedding gradients", embed_grads + job.params(embed) * d + micro)),
    }
    phase = max(phases, key=lambda k: sum(n for _, n in phases[k]))
    host = (
        ("masters and moments", job.arenas),
        ("host block inputs", b * choice.on_host + PAGE if choice.on_host else 0),
        ("kept gradients", (layer_major * block if job.shards == 1 else costs.total_params) * 4 // job.shards
         if job.deferred else 0),
        ("weights (each rank's whole copy)", costs.total_params * d if flat else 0),
        ("compiling", job.compiling),
        ("CUDA libraries", CUDA_RUNTIME_BYTES),
        ("process", job.base_rss),
    )
    unaccounted = (("unaccounted (fitted)", int(UNACCOUNTED * choice.tail * block * d)),) if choice.tail else ()
    return StreamPlan(job, choice, steady + phases[phase] + unaccounted, phase, host, job.load_peak)

