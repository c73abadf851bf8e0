"""What adapters hold (``models.lora``): the pairs' weights, fp32 gradients, masters and moments, and the frozen base
in the compute dtype or NF4 (``core.nf4``); a resident LoRA run's GPU bytes, and a streamed one's GPU and host bytes
(what ``plan.candidates`` offers the one search).

Counted from the adapted spec's leaves, as ``core.footprint`` counts a whole model: what differs is that only the
pairs train (gradient buffers, masters and moments for them alone) and that the base is stored once, frozen.
The activations are the base model's (a pair adds a rank-wide intermediate, ``r / width`` of its input's bytes,
and with ``lora.dropout`` its dropped input: not counted). Loading holds what is kept so far and a leaf in flight
(``lora_load_bytes``), never the model in fp32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nanotrain.core.footprint import MemoryPlan, divisors, estimate, logits_vocab, moments_per_param
from nanotrain.core.machine import GIB
from nanotrain.core.frozen import quantized
from nanotrain.core.leaves import in_flight, load_peak
from nanotrain.core.models.spec import ModelSpec
from nanotrain.core.nf4 import dequant_bytes, nf4_bytes
from nanotrain.core.recompute import RecomputePolicy


def adapter_params(spec: ModelSpec) -> int:
    """The pairs' parameters (every trainable leaf of an adapted spec)."""
    return sum(math.prod(leaf.shape) for leaf in spec.leaves if leaf.trainable)


def adapter_state_bytes(spec: ModelSpec, adam_bits: int) -> int:
    """The pairs' fp32 masters and AdamW moments (8-bit moments for the pairs' matrices, as ``OffloadConfig`` gives)."""
    return int(adapter_params(spec) * (4 + moments_per_param(adam_bits)))


def frozen_bytes(spec: ModelSpec, dtype_bytes: int, base_bits: int, paths: tuple[str, ...] | None = None) -> int:
    """The frozen base (or its leaves ``paths``): the blocks' matrices in NF4 when ``base_bits`` is 4, the rest in
    the compute dtype."""
    leaves = [spec.leaf(p) for p in paths] if paths is not None else spec.leaves
    return sum(nf4_bytes(math.prod(leaf.shape)) if base_bits == 4 and quantized(spec, leaf.path)
               else math.prod(leaf.shape) * dtype_bytes for leaf in leaves if not leaf.trainable)


def dequant_peak(spec: ModelSpec, dtype_bytes: int, base_bits: int) -> int:
    """A 4-bit base's largest matrix dequantised for its matmul (``core.nf4``), beside the activations; 0 in bf16."""
    return max((dequant_bytes(math.prod(leaf.shape), dtype_bytes) for leaf in spec.leaves
                if base_bits == 4 and not leaf.trainable and quantized(spec, leaf.path)), default=0)


def frozen_head(spec: ModelSpec, plain: MemoryPlan) -> int:
    """``estimate``'s LM-head bytes less the head matrix's fp32 gradient, which a frozen head has not."""
    return plain.head - logits_vocab(spec.costs.vocab) * spec.costs.width * 4


def lora_estimate(spec: ModelSpec, micro_batch: int, seq: int, policy: RecomputePolicy, dtype_bytes: int = 2,
                  base_bits: int = 16, states: int = 0) -> MemoryPlan:
    """A resident LoRA run's GPU bytes: the frozen base and the pairs as weights, the pairs' fp32 gradients, the
    base model's activations and head chunk; ``states``: the pairs' masters and moments where they sit on the GPU."""
    plain = estimate(spec, micro_batch, seq, policy, dtype_bytes)
    n = adapter_params(spec)
    weights, grads = frozen_bytes(spec, dtype_bytes, base_bits) + n * dtype_bytes, 4 * n
    head = frozen_head(spec, plain)
    activations = plain.activations + dequant_peak(spec, dtype_bytes, base_bits)
    total = weights + grads + activations + head + states
    return MemoryPlan(micro_batch, weights, grads, activations, head, states, total)


@dataclass(frozen=True)
class StreamedLoraBytes:
    """A streamed LoRA step (``stream.trainer``: two block slots, the embedding's and the head's, block inputs kept on
    the GPU, one micro-batch's block recomputed at a time)."""
    slots: int        # two blocks' base (as stored) and pairs (weights, masters, moments), the embedding, the head
    grads: int        # one block's pairs' fp32 gradient, the head's chunk
    boundaries: int   # every block's input for the whole batch, in the compute dtype (two staged for those on the host)
    activations: int  # one micro-batch's block, recomputed with autograd (a 4-bit base's matrix dequantised)
    host: int         # every unit's base and the pairs' masters and moments, in host memory

    @property
    def gpu(self) -> int:
        return self.slots + self.grads + self.boundaries + self.activations

    def describe(self) -> str:
        return (f"slots {self.slots / GIB:.2f} + gradients {self.grads / GIB:.2f} + block inputs "
                f"{self.boundaries / GIB:.2f} + activations {self.activations / GIB:.2f} = "
                f"{self.gpu / GIB:.2f} GiB on the GPU allocated at the peak; host {self.host / GIB:.2f} GiB")


@dataclass(frozen=True)
class Stored:
    """An adapted spec's bytes that no streamed plan's choice changes, counted once (``stored``): a search weighs
    thousands of plans, and each count walks every leaf (a 70B model's search spent 100 s on them)."""
    dtype_bytes: int
    pair_params: int  # one block's pairs
    block: int        # one block's base as stored
    slots: int        # two blocks' base (as stored) and pairs (weights, masters, moments), the embedding, the head
    dequant: int      # ``dequant_peak``
    host: int         # every unit's base and the pairs' masters and moments, in host memory


def stored(spec: ModelSpec, dtype_bytes: int = 2, base_bits: int = 16, adam_bits: int = 32) -> Stored:
    """``spec``'s ``Stored`` bytes with the base in ``base_bits`` and the pairs' moments in ``adam_bits``."""
    block = spec.block_units[0].paths
    pair_params = sum(math.prod(spec.leaf(p).shape) for p in block if spec.leaf(p).trainable)
    per_pair = pair_params * (dtype_bytes + 4 + moments_per_param(adam_bits))
    ends = frozen_bytes(spec, dtype_bytes, base_bits, spec.embed_unit.paths + spec.head_unit.paths)
    base = frozen_bytes(spec, dtype_bytes, base_bits, block)
    return Stored(dtype_bytes, pair_params, base, int(2 * (base + per_pair) + ends),
                  dequant_peak(spec, dtype_bytes, base_bits),
                  frozen_bytes(spec, dtype_bytes, base_bits) + adapter_state_bytes(spec, adam_bits))


def streamed_lora_bytes(spec: ModelSpec, kept: Stored, batch: int, micro_batch: int, seq: int,
                        on_host: int = 0) -> StreamedLoraBytes:
    """``kept``: ``stored(spec, ...)``; ``on_host``: the first blocks' inputs in host memory
    (``StreamConfig.on_host``), two staged through the GPU."""
    plain = estimate(spec, micro_batch, seq, RecomputePolicy("every"), kept.dtype_bytes)
    costs = spec.costs
    activations = costs.activation_bytes("none") * micro_batch * seq * kept.dtype_bytes // 2 + kept.dequant
    inputs = batch * seq * costs.width * kept.dtype_bytes  # one block's, for the whole batch
    return StreamedLoraBytes(kept.slots, 4 * kept.pair_params + frozen_head(spec, plain),
                             (costs.n_layer - on_host + min(on_host, 2)) * inputs, activations,
                             kept.host + on_host * inputs)


def lora_load_bytes(spec: ModelSpec, dtype_bytes: int = 2, base_bits: int = 16, adam_bits: int = 32,
                    streamed: bool = True) -> int:
    """Host bytes at the peak of an adapted model's load (``core.leaves.load_peak``), each leaf read in the compute
    dtype (a random model's, most checkpoints') as the trainer takes it. Per unit, what the trainer keeps in host
    memory: streamed, its base as stored and its pairs' masters and moments; resident, its pairs' fp32 masters (the
    base goes to the GPU); in flight, its largest leaf (``in_flight``: read, and quantised into its NF4 codes)."""
    def kept(paths: tuple[str, ...]) -> int:
        pairs = sum(math.prod(spec.leaf(p).shape) for p in paths if spec.leaf(p).trainable)
        base = frozen_bytes(spec, dtype_bytes, base_bits, paths) if streamed else 0
        return base + pairs * (4 + moments_per_param(adam_bits) if streamed else 4)

    def flight(path: str) -> int:
        n = math.prod(spec.leaf(path).shape)
        return in_flight(n, dtype_bytes, nf4_bytes(n) if base_bits == 4 and quantized(spec, path) else 0)

    return load_peak((kept(u.paths), max(map(flight, u.paths))) for u in spec.units)
