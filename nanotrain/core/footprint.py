"""How much GPU memory and time the resident trainer needs, and the arithmetic every engine's footprint shares.

An estimate from the model's cost table (``ModelSpec.costs``), so a plan that cannot fit is refused
before anything is allocated (and testable without a GPU). Activations are the table's bytes per token
per block by recompute policy (bf16 compute, fused attention), or, for blocks compiled without recompute,
what inductor saves (``compiled``). An estimate is the allocated peak it predicts: what the GPU runs check
against ``torch.cuda.max_memory_allocated``; what the allocator needs beyond it is the ``margin`` a plan keeps
free of the cap, the same for every engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nanotrain.core.loss import VOCAB_ALIGN
from nanotrain.core.machine import CUDA_RUNTIME_BYTES, GIB
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.core.models import model_spec
from nanotrain.core.models.spec import ModelSpec

MOMENT_BLOCK = 2048  # elements per 8-bit moment block, each with an fp32 scale (``optim.units.OffloadConfig``)
MIN_8BIT_NUMEL = 4096  # smaller leaves keep 32-bit moments (``optim.units.OffloadConfig.min_8bit_numel``)
# A block's backward temporaries beside its recomputed activations, in bytes per token at 2 bytes an element
# per output of the MLP's first matmul: 26 C for GPT-2 (4 C outputs), fitted with ``activation_bytes("none")`` to
# the streamed gpt2-xl at micro-batch 8 (fits) and 16 (ran out of an 11 GiB cap), H200, torch 2.11.
BACKWARD_TEMPS = 6.5


@dataclass(frozen=True)
class MemoryPlan:
    micro_batch: int
    weights: int      # low-precision weights the GPU computes with
    grad_accum: int   # fp32 gradient accumulation buffers
    activations: int  # saved activations of one micro-batch, plus one block recomputed and back-propagated
    head: int         # one chunk of the fused LM-head loss
    states: int       # fp32 masters and moments, where they live on the GPU (``--states gpu``)
    total: int        # the allocated peak (a plan keeps ``margin`` of the cap free beside it)

    def describe(self) -> str:
        states = f" + masters and moments {self.states / GIB:.2f}" if self.states else ""
        return (f"micro-batch {self.micro_batch}: weights {self.weights / GIB:.2f} + gradient accumulation "
                f"{self.grad_accum / GIB:.2f} + activations {self.activations / GIB:.2f} + LM head "
                f"{self.head / GIB:.2f}{states} GiB = {self.total / GIB:.2f} GiB allocated at the peak")


def logits_vocab(vocab: int) -> int:
    """The vocabulary as the LM-head loss pads it (``nanotrain.core.loss``)."""
    return -(-vocab // VOCAB_ALIGN) * VOCAB_ALIGN


def moments_per_param(bits: int, block: int = MOMENT_BLOCK) -> float:
    """AdamW's two moments' bytes per parameter: 8 at 32 bits; at 8 bits one each and two fp32 scales per block."""
    return 8 if bits == 32 else 2 + 8 / block


def leaf_moment_bytes(spec: ModelSpec, path: str, bits: int) -> int:
    """A leaf's moments as ``OffloadConfig.moment_bits`` keeps them: 8-bit codes and an fp32 scale per block of each
    moment, or fp32 (leaves under ``MIN_8BIT_NUMEL`` and ``spec.fp32_moments``, the embeddings)."""
    n = math.prod(spec.leaf(path).shape)
    if bits == 8 and n >= MIN_8BIT_NUMEL and path not in spec.fp32_moments:
        return 2 * n + 8 * -(-n // MOMENT_BLOCK)
    return 8 * n


def moment_bytes(spec: ModelSpec, params: int, bits: int) -> float:
    """The moments of ``params`` of the model's parameters, each leaf's as ``leaf_moment_bytes`` counts it (a
    shard holds its share of every leaf)."""
    whole = sum(leaf_moment_bytes(spec, leaf.path, bits) for leaf in spec.leaves)
    return whole * params / spec.costs.total_params


def state_bytes(cfg: Any, bits: int, copies: int = 1) -> int:
    """fp32 masters and AdamW's moments of the whole model, ``copies`` times (two for exact skips)."""
    spec = model_spec(cfg)
    n = spec.costs.total_params
    return int(copies * (4 * n + moment_bytes(spec, n, bits)))


def divisors(n: int, most: int | None = None) -> list[int]:
    """The divisors of ``n`` up to ``most``, smallest first: the micro-batches (or group sizes) that split ``n``."""
    return [d for d in range(1, min(n, most or n) + 1) if n % d == 0]


def gib_parts(items: tuple[tuple[str, int], ...]) -> str:
    """``name GiB + name GiB ...`` of the nonzero ``(name, bytes)`` items."""
    return " + ".join(f"{name} {b / GIB:.2f}" for name, b in items if b)


# What a rank of a process group holds on its GPU outside the allocator's count: NCCL's buffers (NCCL_BUFFSIZE, 4
# MiB, for each channel, peer and protocol) and its streams' state. An allowance, not a measurement: the plans that
# ran over 2-4 GPUs left more free than this, none measured it.
COLLECTIVE_BYTES = GIB


def margin(cap: int, expandable: bool, ranks: int = 1) -> int:
    """GPU bytes a plan leaves free under ``cap`` beside its predicted allocated peak, for what no engine's count
    holds: cuBLAS workspaces, compiled kernels' scratch, the allocator's rounding and its fragmentation. 0.5 GiB and
    3% of the cap with expandable segments, 12% without (the fragmentation measured on a GPT-2-shaped 6.6B streamed
    plan under 24 GiB: 2.2 GiB reserved but unallocated; ``machine.allocator_setting``); over several ``ranks``, also
    ``COLLECTIVE_BYTES``."""
    return int(GIB // 2 + (COLLECTIVE_BYTES if ranks > 1 else 0) + (0.03 if expandable else 0.12) * cap)


def cap_for(device_bytes: int, expandable: bool, ranks: int = 1) -> int:
    """The smallest GPU cap whose ``margin`` leaves ``device_bytes``."""
    fixed = GIB // 2 + (COLLECTIVE_BYTES if ranks > 1 else 0)
    return math.ceil((device_bytes + fixed) / (1 - (0.03 if expandable else 0.12)))


def fits(device_bytes: int, cap: int, expandable: bool, ranks: int = 1) -> bool:
    """Whether a predicted allocated peak leaves ``margin`` of the GPU cap free."""
    return device_bytes + margin(cap, expandable, ranks) <= cap


def backward_temps(spec: ModelSpec) -> float:
    """``BACKWARD_TEMPS`` in bytes per token at 2 bytes an element: per output of the MLP's first matmul."""
    matmuls = sum(math.prod(spec.leaf(p).shape) for p in spec.block_units[0].paths
                  if p.rsplit(".", 1)[1] in spec.mlp_keys and len(spec.leaf(p).shape) == 2)
    return BACKWARD_TEMPS * (matmuls - spec.costs.last_matmul) / spec.costs.width


def recompute_bytes(spec: ModelSpec, tokens: int, dtype_bytes: int) -> int:
    """One block recomputed and back-propagated over ``tokens`` by ``core.recompute.block_grads`` (the resident
    trainer's recomputed blocks, every streamed block): its activations without recompute, its backward's
    temporaries, and its weight gradients in the compute dtype."""
    per_token = spec.costs.activation_bytes("none") + backward_temps(spec)
    return int(per_token * tokens * dtype_bytes / 2) + spec.costs.block_params * dtype_bytes


def head_loss_bytes(vocab: int, width: int, tokens: int, dtype_bytes: int, chunk_tokens: int = 2048) -> int:
    """The chunked LM-head loss at its peak over ``vocab`` rows (``core.loss``; a tensor-parallel rank's slice,
    ``tensor_parallel.vocab_parallel``): a chunk's logits in the compute dtype and in fp32, the rows' fp32 gradient,
    and the hidden states' gradient."""
    return int(min(chunk_tokens, tokens) * vocab * (4 + dtype_bytes) + vocab * width * 4 + tokens * width * dtype_bytes)


def estimate(cfg: Any, micro_batch: int, seq: int, policy: RecomputePolicy, dtype_bytes: int = 2,
             chunk_tokens: int = 2048, states: int = 0, compiled: bool = False) -> MemoryPlan:
    """The GPU bytes of a resident run of ``cfg`` (any family's config, or its spec) at their allocated peak;
    ``states``: the bytes of masters and moments kept on the GPU (``state_bytes``), 0 where they live in host
    memory; ``compiled``: blocks compiled, which the trainers do only where the policy recomputes nothing
    (``RecomputePolicy.block_fn``), so that they keep what inductor saves."""
    spec = model_spec(cfg)
    costs = spec.costs
    n, c, tokens = costs.total_params, costs.width, micro_batch * seq
    scale = dtype_bytes / 2
    whole = "none" if policy.kind == "every-k" else policy.kind  # what a block not recomputed keeps
    whole = "compiled" if compiled and policy.kind == "none" else whole
    per_layer_sum = sum(costs.activation_bytes("every" if policy.recomputes_block(i) else whole)
                        for i in range(costs.n_layer))
    recompute_one_block = recompute_bytes(spec, tokens, dtype_bytes) if policy.kind not in ("none", "lean") else 0
    activations = int(tokens * per_layer_sum * scale + recompute_one_block)
    head = head_loss_bytes(logits_vocab(costs.vocab), c, tokens, dtype_bytes, chunk_tokens)
    weights, grad_accum = n * dtype_bytes, n * 4
    total = weights + grad_accum + activations + head + states
    return MemoryPlan(micro_batch, weights, grad_accum, activations, head, states, total)


# AdamW over masters and moments in host memory, parameters per second on one host, all its ranks together: fitted
# to issue 37's table (4 x H100 host, torch 2.11): llama-3.2-1b (1.24B) at --states cpu ran 2.0 s a step at batch 32,
# the same run at --states gpu 0.52 s; at --dp 4 --zero 1 (a quarter each, the host shared) 1.2-2.0 s.
HOST_ADAM_PARAMS_S = 0.6e9


def redo_flops(cfg: Any, seq: int, policy: RecomputePolicy) -> float:
    """FLOPs per token that a recompute policy adds: a block's forward again for each block it recomputes
    (``selective`` counted as a whole block: an upper bound), nothing for ``none`` and ``lean``."""
    costs = model_spec(cfg).costs
    if policy.kind in ("none", "lean"):
        return 0.0
    again = costs.n_layer if policy.kind == "selective" else sum(map(policy.recomputes_block, range(costs.n_layer)))
    return again * costs.block_forward_flops(seq)


def resident_step_s(cfg: Any, batch: int, seq: int, micro_batch: int, policy: RecomputePolicy, flops: float,
                    pass_overhead_s: float, host_params: int = 0) -> float:
    """The resident trainer's step over ``batch`` sequences: compute at ``flops`` (a fixed ``pass_overhead_s`` per
    block, pass and action: forward, backward, a recompute), or, when ``host_params`` of masters and moments are
    updated in host memory (``--states cpu``), the host's AdamW over them if longer: the next step's forward waits
    for it. On the GPU the update runs unit by unit inside the backward."""
    costs = model_spec(cfg).costs
    per_token = costs.flops_per_token(seq) + redo_flops(cfg, seq, policy)
    actions = 3 if policy.kind not in ("none", "lean") else 2
    compute = batch * seq * per_token / flops + actions * costs.n_layer * (batch // micro_batch) * pass_overhead_s
    return max(compute, host_params / HOST_ADAM_PARAMS_S)


# What inductor keeps in a process's host memory once it has compiled a function for a GPU with a cold cache (Triton's
# kernels, its compiler's state, the generated modules), per function compiled (a block's forward and backward are one:
# ``torch.compile(run.block)``). Cold against warm cache on one GPU (torch 2.11): gpt2-large resident, one function (the
# block), +1.05 GiB; llama-3.1-8b streamed, three (block, trunk, fp32 accumulation), +4.1 GiB: (1.05 + 4.1) / 4 = 1.29
# a function. On the CPU (C++ kernels) the first compile adds 0.15-0.18 GiB and each further graph a few MiB, alike at
# every width and family (``tests/core/test_compile_rss.py``): what compiling holds grows with the functions compiled,
# not with the batch or the model's width. A warm cache needs less; a plan counts the cold first step. It over-counts
# where other terms leave room (2026-11-28, one H200, cold): llama-3.1-8b streamed at 16 GiB peaked at 64.53 GiB of RSS
# against 62.04 counted without compiling (+2.5 for three functions), a 70B QLoRA at 47.10 against 48.38 (none seen).
COMPILE_HOST_BYTES = int(1.3 * GIB)


# ---------------------------------------------------------------------------------------------
# The resident trainer's host memory: its optimizer state, and without a GPU everything else too.

@dataclass(frozen=True)
class HostPlan:
    total: int
    detail: str

    def describe(self) -> str:
        return f"{self.total / GIB:.2f} GiB ({self.detail})"


def plan_resident_host(cfg: Any, micro_batch: int, seq: int, policy: RecomputePolicy, state_bits: int,
                       states_on_host: bool, on_gpu: bool, base_rss: int = 0, fp16: bool = False,
                       shards: int = 1, exact_skip: bool = False, compiled: bool = False) -> HostPlan:
    """Host memory of a resident run: with ``states_on_host``, fp32 masters, moments and the offloaded
    optimizer's gradient and staging copies; without a GPU, also the weights computed with, their
    fp32 gradient sums and the activations (``estimate`` at 4 bytes); with one, CUDA's libraries.
    ``fp16``: gradients travel in fp32; ``exact_skip``: a second copy of masters and moments (clipping that
    keeps the overlap, ``optim.clip_redo``, and fp16 under data parallelism);
    ``shards``: ZeRO ranks sharing the optimizer state (each holds 1/N of it); ``compiled``: the block compiled
    (``RecomputePolicy.block_fn``), what inductor keeps (``COMPILE_HOST_BYTES``, a GPU's: on the CPU, more than it
    keeps)."""
    n = model_spec(cfg).costs.total_params
    weight_bytes = 2 if on_gpu or fp16 else 4
    copies = ((4 if fp16 else weight_bytes) + weight_bytes) * n  # the gradient and staging copies
    state = (state_bytes(cfg, state_bits, 2 if exact_skip else 1) + copies) // shards if states_on_host else 0
    compute = CUDA_RUNTIME_BYTES if on_gpu else estimate(cfg, micro_batch, seq, policy, dtype_bytes=4).total
    compiling = COMPILE_HOST_BYTES if compiled else 0
    detail = (f"masters, moments and offload copies {state / GIB:.2f} + "
              + ("CUDA libraries" if on_gpu else "weights, gradient sums and activations")
              + f" {compute / GIB:.2f} + " + (f"compiling {compiling / GIB:.2f} + " if compiled else "")
              + f"process {base_rss / GIB:.2f} GiB")
    return HostPlan(state + compute + compiling + base_rss, detail)
