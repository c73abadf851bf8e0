"""What both offloaded optimizers share: their config, the check of the units a model is updated in
(``ModelSpec.unit_dict()``), and the checkpoint format of one parameter's masters and moments
(``master.``, ``exp_avg.``, ...)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanotrain.core.optim.adam import AdamState, AdamState8


@dataclass(frozen=True)
class OffloadConfig:
    """How the offloaded optimizers keep and update their state.

    Skipped steps. A step is skipped when any unit's gradient holds inf/NaN: weights, moments and the
    step count stay as they were. The check happens on the device before the gradient leaves it, so
    it costs no host sync. Units are updated as their gradients arrive, so a bad unit may turn up
    after others were already updated:
    * by default (``exact_skip=False``) the update is in place. A skip is exact when the first unit
      of the step is already bad, which is the usual case: a non-finite loss poisons every unit's
      gradient, including the first to arrive. If a bad unit comes after updated ones, the step can
      no longer be undone; the optimizer then raises (from ``weights``) rather than leave a
      half-applied step.
    * with ``exact_skip=True`` every update writes into a second copy of the masters and moments and
      the step is committed by swapping the copies once its last unit was checked, so a skip is
      always exact; units already sent to the device are sent again from the kept masters. This
      costs a second copy of masters and moments in CPU memory, 1.7x the update time with 32-bit
      moments (the copies' memory traffic; 8-bit moments barely notice), and
      ``weights`` waits for the whole previous step, which is free when the unit needed first
      comes last in backward, as a tied embedding does.
    """

    device: str = "cuda"              # where the model computes and its low-precision weights live
    dtype: torch.dtype = torch.bfloat16
    offload: bool = True              # masters and moments in CPU memory (False: on ``device``)
    state_bits: int = 32              # 32, or 8 for block-wise quantized moments
    block: int = 2048                 # elements per quantization block (8-bit)
    min_8bit_numel: int = 4096        # smaller tensors (biases, norms) keep 32-bit moments
    keep_32bit: tuple[str, ...] = ()  # leaf paths with 32-bit moments anyway (the spec's ``fp32_moments``)
    exact_skip: bool = False          # a second copy of masters and moments makes every skip exact
    chunk: int | None = None          # elements per update chunk (None: adam.py's default per device)
    # StreamedAdam: units whose slot keeps only the compute-dtype weights, their masters and moments
    # streamed through two staging buffers of ``stage_numel`` elements at each update (``stream.staged``)
    staged_units: tuple[str, ...] = ()
    stage_numel: int = 1 << 23
    base_bits: int = 16               # a frozen base's blocks' matrices: in ``dtype`` (16), or NF4 (4: ``core.nf4``)

    def __post_init__(self) -> None:
        if self.state_bits not in (8, 32):
            raise ValueError(f"state_bits must be 8 or 32, got {self.state_bits}")
        if self.base_bits not in (4, 16):
            raise ValueError(f"base_bits must be 16 (the compute dtype) or 4 (NF4), got {self.base_bits}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a float dtype, got {self.dtype}")

    @property
    def grad_dtype(self) -> torch.dtype:
        """How gradients travel to the host: in ``dtype``, but fp32 for fp16, whose unscaled gradients would
        flush to zero below ~6e-8 (the loss scale keeps them representable only until they are unscaled)."""
        return torch.float32 if self.dtype == torch.float16 else self.dtype

    def moment_bits(self, path: str, numel: int) -> int:
        """Bits of ``path``'s moments: ``state_bits``, but 32 for small tensors and ``keep_32bit``."""
        return 8 if self.state_bits == 8 and numel >= self.min_8bit_numel and path not in self.keep_32bit else 32


def check_units(units: dict[str, list[str]], leaves: dict[str, torch.Tensor], keep_32bit: tuple[str, ...]) -> None:
    """Every parameter in exactly one unit, and ``keep_32bit`` naming parameters only."""
    listed = [p for paths in units.values() for p in paths]
    if sorted(listed) != sorted(leaves):
        missing, extra = sorted(set(leaves) - set(listed)), sorted(set(listed) - set(leaves))
        twice = sorted({p for p in listed if listed.count(p) > 1})
        raise ValueError(f"units must list every parameter exactly once; missing {missing[:5]}, "
                         f"unknown {extra[:5]}, listed twice {twice[:5]}")
    if unknown := sorted(set(keep_32bit) - set(leaves)):
        raise ValueError(f"keep_32bit names {unknown[:5]}, which are not parameters (e.g. {listed[:3]})")


def resolve_device(cfg: OffloadConfig) -> torch.device:
    """``cfg.device`` with the CUDA index spelled out, or a clear error without CUDA."""
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"OffloadConfig(device={cfg.device!r}) but CUDA is not available; use device='cpu'")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def masters_home(cfg: OffloadConfig) -> torch.device:
    """Where the masters and moments live: host memory when offloaded, else the compute device."""
    return torch.device("cpu") if cfg.offload else resolve_device(cfg)


def state_entries(path: str, shape: torch.Size, master: torch.Tensor, s: AdamState) -> dict[str, torch.Tensor]:
    """One parameter's checkpoint entries (the format both offloaded optimizers save and load)."""
    out = {f"master.{path}": master.view(shape), f"exp_avg.{path}": s.exp_avg.view(shape),
           f"exp_avg_sq.{path}": s.exp_avg_sq.view(shape)}
    if isinstance(s, AdamState8):
        out[f"exp_avg_absmax.{path}"] = s.exp_avg_absmax
        out[f"exp_avg_sq_absmax.{path}"] = s.exp_avg_sq_absmax
    return out


def load_entries(mine: dict[str, torch.Tensor], sd: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Copy checkpoint ``sd`` into the optimizer's own ``mine`` after checking it matches; the step counts."""
    if set(sd) != set(mine):
        missing, extra = sorted(set(mine) - set(sd)), sorted(set(sd) - set(mine))
        raise ValueError(f"optimizer checkpoint does not match this optimizer: missing {missing[:5]}, unexpected "
                         f"{extra[:5]}; was it saved with other units or other state_bits/keep_32bit/"
                         f"min_8bit_numel?")
    for key, t in mine.items():
        if sd[key].shape != t.shape or sd[key].dtype != t.dtype:
            hint = " (another quantization block size?)" if "absmax" in key else ""
            raise ValueError(f"optimizer checkpoint entry {key!r} is {sd[key].dtype} {tuple(sd[key].shape)}, "
                             f"expected {t.dtype} {tuple(t.shape)}{hint}")
    for key, t in mine.items():
        if key not in ("steps", "skipped_steps"):
            t.copy_(sd[key])
    return int(sd["steps"]), int(sd["skipped_steps"])
