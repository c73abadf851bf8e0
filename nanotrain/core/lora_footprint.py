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

from nanotrain.core.footprint import MemoryPlan, backward_temps, estimate, logits_vocab, moments_per_param
from nanotrain.core.machine import GIB
from nanotrain.core.frozen import quantized
from nanotrain.core.leaves import in_flight, load_peak
from nanotrain.core.models.lora import rank
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
    """A streamed LoRA step (``stream.trainer``), its GPU bytes at the peak of the larger of its two phases: the
    head (each pass of the tail and the LM head, no recompute) and a layer-major block's backward (one micro-batch's
    block recomputed with autograd). The frozen embedding and head have no backward."""
    slots: int        # two blocks' base (as stored) and pairs (weights, masters, moments), a third for the tail's
                      # updates, the embedding, the head
    grads: int        # the pairs' fp32 gradients: a layer-major block's and each tail block's
    tail: int         # the tail blocks' weights, kept for the step: their base as stored, their pairs
    boundaries: int   # the layer-major blocks' inputs kept on the GPU, the top output and the gradient flowing
                      # down (two host inputs staged through the GPU)
    host: int         # every unit's base and the pairs' masters and moments, in host memory
    phases: tuple[tuple[str, int], ...]  # each phase's activations: the tail's and the LM head's, a block's recompute

    @property
    def phase(self) -> str:
        """The phase that makes the peak."""
        return max(self.phases, key=lambda p: p[1])[0]

    @property
    def activations(self) -> int:
        return dict(self.phases)[self.phase]

    @property
    def gpu(self) -> int:
        return self.slots + self.grads + self.tail + self.boundaries + self.activations

    def describe(self) -> str:
        return (f"slots {self.slots / GIB:.2f} + gradients {self.grads / GIB:.2f} + tail {self.tail / GIB:.2f} + "
                f"block inputs {self.boundaries / GIB:.2f} + activations ({self.phase}) {self.activations / GIB:.2f} "
                f"= {self.gpu / GIB:.2f} GiB on the GPU allocated at the peak; host {self.host / GIB:.2f} GiB")


@dataclass(frozen=True)
class Stored:
    """An adapted spec's bytes that no streamed plan's choice changes, counted once (``stored``): a search weighs
    thousands of plans, and each count walks every leaf (a 70B model's search spent 100 s on them)."""
    dtype_bytes: int
    pair_params: int  # one block's pairs
    block: int        # one block's base as stored
    slot: int         # a block's slot: its base (as stored) and pairs (weights, masters, moments)
    ends: int         # the embedding's and the head's slots (their frozen leaves as stored)
    dequant: int      # ``dequant_peak``
    host: int         # every unit's base and the pairs' masters and moments, in host memory
    act: float        # ``adapted_activations``: a block's, per token
    temps: float      # ``core.footprint.backward_temps``: its backward's temporaries, per token
    padded: int       # the LM head's frozen output matrix padded to ``logits_vocab`` (0 where it is aligned)


def adapted_activations(spec: ModelSpec) -> float:
    """Bytes per token (at 2 bytes an element) an adapted block keeps for its backward without recompute: the base
    block's eager count (``none``) and each pair's rank-wide intermediate, which its B matrix keeps. An upper bound:
    a frozen base keeps less (a frozen norm weight's product needs not its input, a frozen matrix without a pair
    not its own)."""
    return spec.costs.activation_bytes("none") + 2 * rank(spec) * len(spec.adapters)


def stored(spec: ModelSpec, dtype_bytes: int = 2, base_bits: int = 16, adam_bits: int = 32) -> Stored:
    """``spec``'s ``Stored`` bytes with the base in ``base_bits`` and the pairs' moments in ``adam_bits``."""
    block = spec.block_units[0].paths
    pair_params = sum(math.prod(spec.leaf(p).shape) for p in block if spec.leaf(p).trainable)
    per_pair = pair_params * (dtype_bytes + 4 + moments_per_param(adam_bits))
    ends = frozen_bytes(spec, dtype_bytes, base_bits, spec.embed_unit.paths + spec.head_unit.paths)
    base = frozen_bytes(spec, dtype_bytes, base_bits, block)
    vocab = math.prod(spec.leaf(spec.head_weight).shape[:1])
    padded = dtype_bytes * logits_vocab(vocab) * spec.costs.width if logits_vocab(vocab) != vocab else 0
    return Stored(dtype_bytes, pair_params, base, int(base + per_pair), ends,
                  dequant_peak(spec, dtype_bytes, base_bits),
                  frozen_bytes(spec, dtype_bytes, base_bits) + adapter_state_bytes(spec, adam_bits),
                  adapted_activations(spec), backward_temps(spec), padded)


def streamed_lora_bytes(spec: ModelSpec, kept: Stored, batch: int, micro_batch: int, seq: int, on_host: int = 0,
                        tail: int = 0, tail_micro_batch: int | None = None, chunk_tokens: int = 2048
                        ) -> StreamedLoraBytes:
    """``kept``: ``stored(spec, ...)``; ``on_host``: the first blocks' inputs in host memory (``StreamConfig.on_host``),
    two staged through the GPU; ``tail``: the top blocks run per pass of ``tail_micro_batch`` sequences;
    ``chunk_tokens``: the LM-head loss's chunk (``StreamConfig.chunk_tokens``).

    As ``stream.footprint`` counts the base model's step, less what a frozen base has not (no weight gradients of
    its own, no fp32 head gradient, no update of the embedding or head): the head phase holds, per pass, the tail's
    activations (``adapted_activations``, no recompute), the final norm's fp32 input and output and the gradient at
    it, and the LM head's chunk (its logits, their gradient, the fp32 softmax; the padded weight), then the tail's
    backward (one block's activations and temporaries beside the others', the pairs' gradients in the compute
    dtype); a block's backward holds one micro-batch's block recomputed, its temporaries and its pairs' gradients.
    A 4-bit base's matrix is dequantised beside either."""
    d, c, n = kept.dtype_bytes, spec.costs.width, spec.costs.n_layer
    per_token = lambda x, tokens: int(x * tokens * d / 2)  # noqa: E731 (the tables count at 2 bytes an element)
    inputs = batch * seq * c * d  # one block's, for the whole batch
    micro = micro_batch * seq * c * d
    tokens = (tail_micro_batch or micro_batch) * seq
    act, temps, pair_grads = per_token(kept.act, tokens), per_token(kept.temps, tokens), kept.pair_params * d
    chunk = min(chunk_tokens, tokens) * logits_vocab(spec.costs.vocab) * (2 * d + 4)
    hidden = tokens * c * (4 + 2 * d)
    tail_back = max(tail * act, act + tail * pair_grads) + temps if tail else 0
    head = hidden + max(tail * act + kept.padded + chunk, tail_back) + kept.dequant
    recompute = (per_token(kept.act + kept.temps, micro_batch * seq) + pair_grads + kept.dequant) if n > tail else 0
    return StreamedLoraBytes(
        (2 + (tail > 0)) * kept.slot + kept.ends, 4 * kept.pair_params * (1 + tail),
        tail * (kept.block + pair_grads), (max(n - tail - on_host, 0) + 1) * inputs + micro + min(on_host, 2) * inputs,
        kept.host + on_host * inputs, (("head", head), ("blocks' backward", recompute)))


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
