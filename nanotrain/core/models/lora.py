"""LoRA: rank-r adapters on chosen matrices of any family, as leaves of the model tree.

``with_lora(spec, cfg)`` is a spec like any other: each block gains, per target, ``lora_<target>_a`` ``[r, in]``
and ``lora_<target>_b`` ``[rows, r]`` in its unit (so every engine moves and hands them over with their block),
and every base leaf is frozen (``Leaf.trainable``: no gradient, no optimizer state). The family says which of
its matrices a target name means (``ModelSpec.lora_targets``: a leaf and a segment of its rows, e.g. Llama's
``q`` is the first segment of the fused ``qkv_w``); nothing here names a family's leaves.

The block's pieces see an adapted matrix as an ``Adapted`` (``carry``, called by ``models.run`` where a
sublayer takes its leaves), which ``core.linear.linear`` computes as PEFT does:
``x W^T + b``, plus on the pair's rows ``B (A dropout(x)) * alpha / r``. Initialised as PEFT does: A
kaiming-uniform (a = sqrt(5), so uniform in +-1/sqrt(in)), B zeros. Dropout masks come from a generator per
adapter seeded from its sublayer's (``run.generators``), so recompute replays them in any order.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from nanotrain.core.linear import linear
from nanotrain.core.models.ops import dropped, keep_mask, make_generator
from nanotrain.core.models.spec import Leaf, ModelSpec, Unit
from nanotrain.core.tree import Tree, get_path, set_path

LORA_A_INIT = "kaiming_uniform"  # ``run.init_stream`` draws it uniform in +-1/sqrt(fan in), as PEFT's A


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q", "v")
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank {self.rank} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout {self.dropout} must be in [0, 1)")
        if not self.targets:
            raise ValueError("LoRA needs at least one target (e.g. --lora-targets q,v)")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class Adapter:
    """One target's pair in every block: the block leaf it adapts, the segment of its rows (None: all) and those
    rows ``[start, stop)``."""
    target: str
    weight: str
    segment: int | None
    rows: tuple[int, int]
    a: str
    b: str
    scale: float
    dropout: float


def target_rows(spec: ModelSpec, weight: str, segment: int | None) -> tuple[int, int]:
    """The rows of block leaf ``weight`` that ``segment`` of its placement means (None: all of them)."""
    leaf = spec.leaf(f"blocks.0.{weight}")
    if segment is None:
        return 0, leaf.shape[0]
    rows = spec.segment_rows(leaf)
    return sum(rows[:segment]), sum(rows[:segment + 1])


def with_lora(spec: ModelSpec, cfg: LoraConfig) -> ModelSpec:
    """``spec`` with rank-``cfg.rank`` adapters on ``cfg.targets`` in every block and its base frozen."""
    known = {name: (weight, segment) for name, weight, segment in spec.lora_targets}
    if unknown := [t for t in cfg.targets if t not in known]:
        raise ValueError(f"LoRA target(s) {', '.join(unknown)} are not {spec.family}'s "
                         f"(known: {', '.join(known) or 'none'}); pick from those with --lora-targets")
    if spec.adapters or spec.frozen:
        raise ValueError(f"{spec.family} spec already has adapters or frozen leaves; adapt the base spec once")
    if not spec.n_layer:
        raise ValueError("LoRA adapts the blocks' matrices; this model has no block")
    adapters = tuple(Adapter(t, *known[t], target_rows(spec, *known[t]), f"lora_{t}_a", f"lora_{t}_b",
                             cfg.scale, cfg.dropout) for t in dict.fromkeys(known) if t in cfg.targets)

    def pair(i: int, ad: Adapter) -> tuple[Leaf, Leaf]:
        fan_in = spec.leaf(f"blocks.{i}.{ad.weight}").shape[1]
        return (Leaf(f"blocks.{i}.{ad.a}", (cfg.rank, fan_in), LORA_A_INIT),
                Leaf(f"blocks.{i}.{ad.b}", (ad.rows[1] - ad.rows[0], cfg.rank), "zeros"))

    added = {unit.name: [leaf for ad in adapters for leaf in pair(unit.index, ad)] for unit in spec.block_units}
    leaves = []
    for unit in spec.units:  # checkpoint order: each block's adapters after its own leaves
        leaves += [replace(spec.leaf(p), trainable=False) for p in unit.paths] + added.get(unit.name, [])
    units = tuple(Unit(u.name, u.paths + tuple(leaf.path for leaf in added.get(u.name, [])), u.index)
                  for u in spec.units)
    attn = tuple(n for ad in adapters if ad.weight in spec.attn_keys for n in (ad.a, ad.b))
    mlp = tuple(n for ad in adapters if ad.weight in spec.mlp_keys for n in (ad.a, ad.b))
    # ``mlp_keys`` keeps the block's last matmul last (its readers cut the MLP there)
    return replace(spec, leaves=tuple(leaves), units=units, adapters=adapters, fp32_moments=(),
                   attn_keys=spec.attn_keys + attn, mlp_keys=(*spec.mlp_keys[:-1], *mlp, spec.mlp_keys[-1]),
                   dropout=replace(spec.dropout, lora=cfg.dropout))


class Adapted:
    """A matrix with its LoRA pairs, as a block's matmul takes it: ``core.linear.linear`` calls ``linear``."""

    def __init__(self, base: torch.Tensor, pairs: tuple[tuple[Adapter, torch.Tensor, torch.Tensor, int | None], ...]):
        self.base, self.pairs = base, pairs

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = linear(x, self.base, bias)  # a tensor, or a 4-bit base (``core.nf4``)
        for ad, a, b, seed in self.pairs:
            xd = x if seed is None else dropped(x, keep_mask(x.shape, ad.dropout, make_generator(seed, x.device),
                                                             x.device), ad.dropout)
            delta = F.linear(F.linear(xd, a), b) * ad.scale
            if ad.rows == (0, y.shape[-1]):
                y = y + delta
            else:  # a segment of a fused matrix; F.linear's backward does not read y, so adding in place is exact
                y[..., ad.rows[0]:ad.rows[1]] += delta
        return y


def carry(spec: ModelSpec, p: dict, gen: torch.Generator | None) -> dict:
    """A sublayer's leaves ``p`` with each adapted matrix an ``Adapted`` (pairs whose leaves ``p`` lacks are
    another sublayer's); ``gen``: the sublayer's dropout generator, whose seed seeds each pair's masks."""
    if not spec.adapters:
        return p
    out = dict(p)
    for k, ad in enumerate(spec.adapters):
        if ad.a not in p or ad.weight not in p:
            continue
        seed = None if gen is None or ad.dropout == 0 else (gen.initial_seed() * 16 + k + 1) % (1 << 63)
        held = out[ad.weight]
        base, pairs = (held.base, held.pairs) if isinstance(held, Adapted) else (held, ())
        out[ad.weight] = Adapted(base, pairs + ((ad, p[ad.a], p[ad.b], seed),))
    return out


def adapts(spec: ModelSpec, weight: str) -> bool:
    """Whether block leaf ``weight`` carries adapters."""
    return any(ad.weight == weight for ad in spec.adapters)


def rank(spec: ModelSpec) -> int:
    """The adapters' rank (A's rows)."""
    return spec.leaf(f"blocks.0.{spec.adapters[0].a}").shape[0]


def merge(spec: ModelSpec, base: Tree, adapters: Tree) -> Tree:
    """The base tree (the base spec's leaves) with every pair merged in: ``W[rows] += scale * B @ A``, in fp32
    and back to each weight's dtype (a plain Hugging Face folder then needs no adapter). ``base`` is not changed."""
    out = {k: (list(map(dict, v)) if k == "blocks" else v) for k, v in base.items()}
    for unit in spec.block_units:
        for ad in spec.adapters:
            path = f"blocks.{unit.index}."
            w = get_path(out, path + ad.weight)
            a, b = get_path(adapters, path + ad.a).float(), get_path(adapters, path + ad.b).float()
            merged = w.float().clone()  # no detach: a pair merged before on this weight keeps its graph
            merged[ad.rows[0]:ad.rows[1]] += ad.scale * (b @ a)
            set_path(out, path + ad.weight, merged.to(w.dtype))
    return out
