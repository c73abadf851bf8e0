"""AdamW with fp32 master weights and moments in CPU memory, updated unit by unit during backward.

The parameters are grouped into units (for GPT-2: the embeddings, each block, the final norm; see
``gpt2_units``). The device holds only the low-precision weights the model computes with, in
``OffloadAdam.params``; the fp32 masters and the moments live in CPU memory. One step of a unit:

1. ``grads_ready(unit, grads)`` is called by the trainer as soon as the unit's gradient is final
   (last micro-batch, the unit's backward done). On a side stream that first waits for the compute
   stream, it checks the gradient for inf/NaN and copies it into pinned host memory, then queues
   the CPU update on a worker thread and returns at once: the GPU goes on with the backward.
2. The worker waits for that copy, runs ``adam_step`` on the masters and moments (vectorised,
   on torch's intra-op threads: set their number with ``torch.set_num_threads``; the GIL is
   released inside each op), writes the new weights in the device
   dtype into a pinned staging buffer and starts their copy into the unit's device tensors on a
   second side stream, recording an event.
3. ``wait_params(unit)``, called before the next forward uses the unit, waits for the worker and
   makes the compute stream wait for that event; it costs nothing when the update is long done.

The device copies run on their own streams so that gradients going down and weights going up
overlap each other and the compute. The rules that make this safe: the trainer must not touch a
unit's weights after its ``grads_ready`` until ``wait_params`` of that unit, nor write into the
gradient tensors it passed until then (freeing them is fine: ``record_stream`` covers it).

Skipped steps. A step is skipped when any unit's gradient holds inf/NaN: weights, moments and the
step count stay as they were. The check happens on the device before the gradient leaves it, so
it costs no host sync. Units are updated as their gradients arrive, so a bad unit may turn up
after others were already updated:
* by default (``exact_skip=False``) the update is in place. A skip is exact when the first unit
  of the step is already bad, which is the usual case: a non-finite loss poisons every unit's
  gradient, including the first to arrive. If a bad unit comes after updated ones, the step can
  no longer be undone; the optimizer then raises (from ``wait_params``) rather than leave a
  half-applied step.
* with ``exact_skip=True`` every update writes into a second copy of the masters and moments and
  the step is committed by swapping the copies once its last unit was checked, so a skip is
  always exact; units already sent to the device are sent again from the kept masters. This
  costs a second copy of masters and moments in CPU memory, 1.7x the update time with 32-bit
  moments (the copies' memory traffic; 8-bit moments barely notice), and
  ``wait_params`` waits for the whole previous step, which is free when the unit needed first
  comes last in backward, as GPT-2's tied embedding does.

Gradient clipping by global norm is not offered: it needs every gradient before the first
update, which is exactly the overlap this optimizer exists for.

With ``offload=False`` masters and moments stay on the device (e.g. 8-bit moments when they fit)
and each unit is updated inline on the compute stream; reading its inf/NaN flag then costs one
host sync per unit. On a CPU-only machine the "device" is the CPU and the copies are plain copies.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import torch

from nanotrain.config import GPT2Config
from nanotrain.model import param_spec
from nanotrain.optim.adam import AdamConfig, AdamState, AdamState8, adam_step, init_state
from nanotrain.optim.scratch import Scratch
from nanotrain.tree import Tree, named_leaves, set_path, tree_map


@dataclass(frozen=True)
class OffloadConfig:
    device: str = "cuda"              # where the model computes and its low-precision weights live
    dtype: torch.dtype = torch.bfloat16
    offload: bool = True              # masters and moments in CPU memory (False: on ``device``)
    state_bits: int = 32              # 32, or 8 for block-wise quantized moments
    block: int = 2048                 # elements per quantization block (8-bit)
    min_8bit_numel: int = 4096        # smaller tensors (biases, norms) keep 32-bit moments
    keep_32bit: tuple[str, ...] = ()  # leaf paths with 32-bit moments anyway, e.g. ("wte", "wpe")
    exact_skip: bool = False          # a second copy of masters and moments makes every skip exact
    chunk: int | None = None          # elements per update chunk (None: adam.py's default per device)

    def __post_init__(self) -> None:
        if self.state_bits not in (8, 32):
            raise ValueError(f"state_bits must be 8 or 32, got {self.state_bits}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a float dtype, got {self.dtype}")

    def moment_bits(self, path: str, numel: int) -> int:
        """Bits of ``path``'s moments: ``state_bits``, but 32 for small tensors and ``keep_32bit``."""
        return 8 if self.state_bits == 8 and numel >= self.min_8bit_numel and path not in self.keep_32bit else 32


def gpt2_units(cfg: GPT2Config) -> dict[str, list[str]]:
    """GPT-2's units in forward order: ``embed`` (wte, wpe), ``blocks.i`` each, ``ln_f``."""
    units: dict[str, list[str]] = {}
    for path, _, _ in param_spec(cfg):
        unit = "embed" if path in ("wte", "wpe") else "ln_f" if path.startswith("ln_f") else path.rsplit(".", 1)[0]
        units.setdefault(unit, []).append(path)
    return units


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


def _all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.isfinite(t).all() for t in tensors]).all()


@dataclass
class _Unit:
    name: str
    paths: list[str]
    device: list[torch.Tensor]         # the weights the model computes with (leaves of ``params``)
    master: list[torch.Tensor]         # flat fp32, committed
    state: list[AdamState]
    shadow: tuple[list[torch.Tensor], list[AdamState]] | None  # where an exact-skip step writes
    grad_host: list[torch.Tensor] = field(default_factory=list)  # flat, pinned on CUDA (offload)
    staging: list[torch.Tensor] = field(default_factory=list)    # flat new weights to upload (offload)
    finite_host: torch.Tensor | None = None
    job: concurrent.futures.Future | None = None
    uploaded: torch.cuda.Event | None = None


class OffloadAdam:
    """AdamW over a parameter tree whose units are updated as their gradients become final.

    ``params`` is a tree of float tensors (any device): its values become the fp32 masters. With
    ``copy=False``, leaves that already are contiguous fp32 tensors where the masters live are taken
    over as the masters themselves instead of copied: no second copy of the model in host memory
    while the optimizer is built; the caller must not use those tensors afterwards.
    ``units`` maps each unit's name to the dotted paths of its leaves; every leaf is in one unit.
    ``hp`` may be replaced between steps (e.g. a learning-rate schedule): each unit's update uses
    the value it had when ``grads_ready`` was called.
    """

    def __init__(self, params: Tree, units: dict[str, list[str]], hp: AdamConfig, cfg: OffloadConfig,
                 copy: bool = True):
        self.hp, self.cfg, self._copy = hp, cfg, copy
        self.device = resolve_device(cfg)
        self._cuda = self.device.type == "cuda"
        leaves = dict(named_leaves(params))
        check_units(units, leaves, cfg.keep_32bit)
        self.params: Tree = tree_map(lambda t: None, params)
        state_device = torch.device("cpu") if cfg.offload else self.device
        self._units = {name: self._make_unit(name, paths, leaves, state_device) for name, paths in units.items()}
        self._scratch = Scratch()  # used by the one thread that runs updates
        if cfg.offload:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanotrain-adam")
        if self._cuda and cfg.offload:
            self._d2h, self._h2d = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        # Main thread: which units still owe their gradient this step. Worker (or inline): the rest.
        self._waiting = set(self._units)
        self._last_job: concurrent.futures.Future | None = None
        self._closing_job: concurrent.futures.Future | None = None
        self._steps, self._skipped = 0, 0
        self._applied: list[_Unit] = []
        self._bad = False
        self._broken: str | None = None

    def _master(self, t: torch.Tensor, state_device: torch.device) -> torch.Tensor:
        """The flat fp32 master of ``t``: never sharing ``t``'s memory unless ``copy=False``."""
        flat = t.detach().to(state_device, torch.float32).flatten()
        shares = flat.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        return flat.clone() if self._copy and shares else flat

    def _make_unit(self, name: str, paths: list[str], leaves: dict[str, torch.Tensor], state_device: torch.device) -> _Unit:
        cfg, pin = self.cfg, self._cuda and self.cfg.offload
        master = [self._master(leaves[p], state_device) for p in paths]
        bits = [cfg.moment_bits(p, m.numel()) for p, m in zip(paths, master)]
        device = [leaves[p].detach().to(self.device, cfg.dtype).contiguous().clone() for p in paths]
        for p, d in zip(paths, device):
            set_path(self.params, p, d)
        new_state = lambda: [init_state(m, b, cfg.block) for m, b in zip(master, bits)]  # noqa: E731
        shadow = ([m.clone() for m in master], new_state()) if cfg.exact_skip else None
        unit = _Unit(name, paths, device, master, new_state(), shadow)
        if cfg.offload:
            host = lambda: [torch.empty(m.numel(), dtype=cfg.dtype, pin_memory=pin) for m in master]  # noqa: E731
            unit.grad_host, unit.staging = host(), host()
            unit.finite_host = torch.empty((), dtype=torch.bool, pin_memory=pin)
        return unit

    # -- the per-unit protocol ---------------------------------------------------------------

    def grads_ready(self, unit: str, grads: list[torch.Tensor]) -> None:
        """Hand over ``unit``'s final gradients (in the order of its paths) for this step's update."""
        u = self._unit(unit)
        if unit not in self._waiting:
            raise RuntimeError(f"unit {unit!r} already got its gradients this step; each unit gets them once per "
                               f"step, and the step ends when every unit has (still owed: {sorted(self._waiting)[:5]})")
        if len(grads) != len(u.paths):
            raise ValueError(f"unit {unit!r} has {len(u.paths)} parameters {u.paths}, got {len(grads)} gradients")
        for path, g, d in zip(u.paths, grads, u.device):
            if g.shape != d.shape or g.device != self.device:
                raise ValueError(f"gradient of {path!r} is {tuple(g.shape)} on {g.device}, "
                                 f"the parameter {tuple(d.shape)} on {self.device}")
        self._waiting.discard(unit)
        closes = not self._waiting
        if closes:
            self._waiting = set(self._units)
        hp = self.hp
        if not self.cfg.offload:
            self._update(u, grads, bool(_all_finite(grads)), None, hp, closes)
            return
        if u.job is not None:
            u.job.result()  # its buffers are about to be reused (long done, in any sane schedule)
        finite, copied = self._send(u, grads)
        u.job = self._last_job = self._worker.submit(self._update, u, u.grad_host, finite, copied, hp, closes)
        if closes:
            self._closing_job = u.job

    def wait_params(self, unit: str) -> list[torch.Tensor]:
        """``unit``'s device weights (in the order of its paths), safe to use on the current stream."""
        u = self._unit(unit)
        if u.job is not None:
            u.job.result()  # re-raises what went wrong in the worker
        if self.cfg.exact_skip and self._closing_job is not None:
            self._closing_job.result()  # a later unit of that step may still undo this one
        if u.uploaded is not None:
            torch.cuda.current_stream(self.device).wait_event(u.uploaded)
        return u.device

    def grad_buffers(self) -> dict[str, torch.Tensor]:
        """Fresh fp32 buffers, one per parameter on the device, where a trainer may accumulate gradients."""
        return {path: torch.empty(d.shape, dtype=torch.float32, device=self.device)
                for u in self._units.values() for path, d in zip(u.paths, u.device)}

    def synchronize(self) -> None:
        """Wait for every queued update (the single worker runs them in order)."""
        if self._last_job is not None:
            self._last_job.result()

    @property
    def steps(self) -> int:
        """Steps applied so far (the Adam step count); exact after ``synchronize``."""
        return self._steps

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for inf/NaN gradients; exact after ``synchronize``."""
        return self._skipped

    def close(self) -> None:
        if self.cfg.offload:
            self._worker.shutdown(wait=True)

    # -- moving data -------------------------------------------------------------------------

    def _unit(self, name: str) -> _Unit:
        if name not in self._units:
            raise KeyError(f"unknown unit {name!r} (known: {', '.join(self._units)})")
        return self._units[name]

    def _send(self, u: _Unit, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying ``grads`` and their all-finite flag to host memory; the event marks the end."""
        if not self._cuda:
            for host, g in zip(u.grad_host, grads):
                host.view(g.shape).copy_(g)
            return _all_finite(grads), None
        # Read the compute stream before entering the side stream: inside ``torch.cuda.stream(...)``
        # the current stream *is* the side stream, and waiting on it would order nothing.
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._d2h):
            self._d2h.wait_stream(compute)  # the gradients are final there
            u.finite_host.copy_(_all_finite(grads), non_blocking=True)
            for host, g in zip(u.grad_host, grads):
                host.view(g.shape).copy_(g, non_blocking=True)
                g.record_stream(self._d2h)  # the trainer may free g before the copy has run
            copied = torch.cuda.Event()
            copied.record(self._d2h)
        return u.finite_host, copied

    def _outputs(self, u: _Unit) -> list[torch.Tensor]:
        """Where new weights are written: the staging buffers once their last upload is done, or
        straight into the device weights when nothing is offloaded."""
        if not self.cfg.offload:
            return [d.view(-1) for d in u.device]
        if u.uploaded is not None:
            u.uploaded.synchronize()
        return u.staging

    def _upload(self, u: _Unit) -> None:
        if not self.cfg.offload:
            return
        if not self._cuda:
            for d, s in zip(u.device, u.staging):
                d.view(-1).copy_(s)
            return
        with torch.cuda.stream(self._h2d):
            for d, s in zip(u.device, u.staging):
                d.view(-1).copy_(s, non_blocking=True)
            u.uploaded = torch.cuda.Event()
            u.uploaded.record(self._h2d)

    def _publish(self, u: _Unit) -> None:
        """Send the committed masters to the device (after a skip undid an update, or a load)."""
        for out, m in zip(self._outputs(u), u.master):
            out.copy_(m)
        self._upload(u)

    # -- the update (worker thread, or inline without offload) -------------------------------

    def _update(self, u: _Unit, grads: list[torch.Tensor], finite: torch.Tensor | bool,
                copied: torch.cuda.Event | None, hp: AdamConfig, closes: bool) -> None:
        if copied is not None:
            copied.synchronize()
        if self._broken:
            raise RuntimeError(self._broken)
        if not self._bad and not bool(finite):
            self._bad = True
            if self._applied and not self.cfg.exact_skip:
                self._broken = (f"step {self._steps + 1}: unit {u.name!r} has inf/NaN gradients but "
                                f"{len(self._applied)} units ({self._applied[0].name!r}, ...) were updated before "
                                f"it arrived; the step cannot be undone. Resume from a checkpoint, and set "
                                f"OffloadConfig(exact_skip=True) to skip such steps exactly")
                raise RuntimeError(self._broken)
            for v in self._applied:
                self._publish(v)
        if not self._bad:
            self._apply(u, grads, hp)
            self._applied.append(u)
        if closes:
            if self._bad:
                self._skipped += 1
            else:
                self._steps += 1
                for v in self._applied if self.cfg.exact_skip else ():
                    (v.master, v.state), v.shadow = v.shadow, (v.master, v.state)
            self._applied, self._bad = [], False

    def _apply(self, u: _Unit, grads: list[torch.Tensor], hp: AdamConfig) -> None:
        outs = self._outputs(u)
        dst_master, dst_state = u.shadow if self.cfg.exact_skip else (u.master, u.state)
        for i, g in enumerate(grads):
            source = (u.master[i], u.state[i]) if self.cfg.exact_skip else None
            adam_step(dst_master[i], g, dst_state[i], hp, self._steps + 1, out=outs[i], chunk=self.cfg.chunk,
                      source=source, scratch=self._scratch)
        self._upload(u)

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Masters, moments and step counts as a flat dict of tensors, ready for safetensors.

        The tensors are the optimizer's own buffers, not copies: save them before the next step.
        They are CPU tensors, or on the device with ``offload=False``.
        Keys: ``master.<path>`` (fp32, the parameter's shape), ``exp_avg.<path>`` and
        ``exp_avg_sq.<path>`` (fp32 or uint8 codes), ``exp_avg_absmax.<path>`` and
        ``exp_avg_sq_absmax.<path>`` (8-bit only), ``steps`` and ``skipped_steps``.
        """
        self.synchronize()
        out = {"steps": torch.tensor(self._steps), "skipped_steps": torch.tensor(self._skipped)}
        for u in self._units.values():
            for path, d, m, st in zip(u.paths, u.device, u.master, u.state):
                out.update(state_entries(path, d.shape, m, st))
        return out

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Restore what ``state_dict`` gave (same units and configuration) and refresh the device weights."""
        self.synchronize()
        self._steps, self._skipped = load_entries(self.state_dict(), sd)
        for u in self._units.values():
            self._publish(u)

