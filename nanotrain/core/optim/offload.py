"""AdamW with fp32 master weights and moments in CPU memory, updated unit by unit during backward.

The parameters are grouped into units (``ModelSpec.unit_dict()``). The device holds only the low-precision
weights the model computes with (``OffloadAdam.params``); masters and moments live in CPU memory. A unit's step:

1. ``update(unit, grads)`` is called by the trainer as soon as the unit's gradient is final
   (last micro-batch, the unit's backward done). On a side stream that first waits for the compute
   stream, it checks the gradient for inf/NaN and copies it into pinned host memory, then queues
   the CPU update on a worker thread and returns at once: the GPU goes on with the backward.
2. The worker waits for that copy, runs ``adam_step`` on the masters and moments (vectorised on
   torch's intra-op threads, ``torch.set_num_threads``; the GIL is released inside each op), writes
   the new weights in the device dtype into a pinned staging buffer and starts their copy into the
   unit's device tensors on a second side stream, recording an event.
3. ``weights(unit)``, called before the next forward uses the unit, waits for the worker and
   makes the compute stream wait for that event; it costs nothing when the update is long done.

The device copies run on their own streams so that gradients going down and weights going up
overlap each other and the compute. The rules that make this safe: the trainer must not touch a
unit's weights after its ``update`` until ``weights`` of that unit, nor write into the
gradient tensors it passed until then (freeing them is fine: ``record_stream`` covers it).

A skipped step (inf/NaN gradient) leaves weights, moments and step count as they were (``exact_skip``).

Clipping by global norm: the resident trainer hands units over after the whole backward, or with
``exact_skip`` updates speculatively and redoes a clipped step from the kept copy (``optim.clip_redo``).

With ``offload=False`` masters and moments stay on the device (e.g. 8-bit moments when they fit)
and each unit is updated inline on the compute stream; reading its inf/NaN flag then costs one
host sync per unit. On a CPU-only machine the "device" is the CPU and the copies are plain copies.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import replace

import torch

from nanotrain.core.optim.adam import AdamConfig, adam_step
from nanotrain.core.optim.buffers import UnitBuffers, all_finite, make_unit
from nanotrain.core.optim.scratch import Scratch
from nanotrain.core.optim.units import (OffloadConfig, check_units, load_entries, masters_home, resolve_device,
                                       state_entries)
from nanotrain.core.tree import Tree, named_leaves, set_path, tree_map


class OffloadAdam:
    """AdamW over a parameter tree whose units are updated as their gradients become final.

    ``params`` is a tree of float tensors (any device): its values become the fp32 masters. With
    ``copy=False``, leaves that already are contiguous fp32 tensors where the masters live are taken
    over as the masters themselves instead of copied: no second copy of the model in host memory
    while the optimizer is built; the caller must not use those tensors afterwards. ``device_weights`` (by path):
    where a leaf's device weights live, a caller's tensor of its size (data parallelism's all-gather input), not a
    tensor of their own.
    ``units`` maps each unit's name to the dotted paths of its leaves; every leaf is in one unit.
    ``set_lr`` may change the learning rate between steps (a schedule): each unit's update uses the
    value it had when ``update`` was called.
    """

    clip_norm: float | None = None  # clips by itself (data parallelism's does): this one leaves it to the trainer

    def __init__(self, params: Tree, units: dict[str, list[str]], hp: AdamConfig, cfg: OffloadConfig,
                 copy: bool = True, device_weights: dict[str, torch.Tensor] | None = None):
        self.hp, self.cfg = hp, cfg
        self.device = resolve_device(cfg)
        self._cuda = self.device.type == "cuda"
        leaves = dict(named_leaves(params))
        check_units(units, leaves, cfg.keep_32bit)
        self.params: Tree = tree_map(lambda t: None, params)
        pin = self._cuda and cfg.offload
        self._units = {name: make_unit(name, paths, leaves, cfg, masters_home(cfg), self.device, copy, pin,
                                       device_weights)
                       for name, paths in units.items()}
        for u in self._units.values():
            for p, d in zip(u.paths, u.device):
                set_path(self.params, p, d)
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
        self._applied: list[UnitBuffers] = []
        self._bad = False
        self._broken: str | None = None

    # -- the per-unit protocol ---------------------------------------------------------------

    def update(self, unit: str, grads: list[torch.Tensor]) -> None:
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
            self._check_and_apply(u, grads, bool(all_finite(grads)), None, hp, closes)
            return
        if u.job is not None:
            u.job.result()  # its buffers are about to be reused (long done, in any sane schedule)
        finite, copied = self._send(u, grads)
        u.job = self._last_job = self._worker.submit(self._check_and_apply, u, u.grad_host, finite, copied, hp, closes)
        if closes:
            self._closing_job = u.job

    def set_lr(self, lr: float) -> None:
        """The lr of units handed over from now on (queued updates keep the frozen ``AdamConfig`` of their moment)."""
        self.hp = replace(self.hp, lr=lr)

    def weights(self, unit: str) -> list[torch.Tensor]:
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

    def _unit(self, name: str) -> UnitBuffers:
        if name not in self._units:
            raise KeyError(f"unknown unit {name!r} (known: {', '.join(self._units)})")
        return self._units[name]

    def _send(self, u: UnitBuffers, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying ``grads`` and their all-finite flag to host memory; the event marks the end."""
        if not self._cuda:
            for host, g in zip(u.grad_host, grads):
                host.view(g.shape).copy_(g)
            return all_finite(grads), None
        # Read the compute stream before entering the side stream: inside ``torch.cuda.stream(...)``
        # the current stream *is* the side stream, and waiting on it would order nothing.
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._d2h):
            self._d2h.wait_stream(compute)  # the gradients are final there
            u.finite_host.copy_(all_finite(grads), non_blocking=True)
            for host, g in zip(u.grad_host, grads):
                host.view(g.shape).copy_(g, non_blocking=True)
                g.record_stream(self._d2h)  # the trainer may free g before the copy has run
            copied = torch.cuda.Event()
            copied.record(self._d2h)
        return u.finite_host, copied

    def _outputs(self, u: UnitBuffers) -> list[torch.Tensor]:
        """Where new weights are written: the staging buffers once their last upload is done, or
        straight into the device weights when nothing is offloaded."""
        if not self.cfg.offload:
            return [d.view(-1) for d in u.device]
        if u.uploaded is not None:
            u.uploaded.synchronize()
        return u.staging

    def _upload(self, u: UnitBuffers) -> None:
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

    def _publish(self, u: UnitBuffers) -> None:
        """Send the committed masters to the device (after a skip undid an update, or a load)."""
        for out, m in zip(self._outputs(u), u.master):
            out.copy_(m)
        self._upload(u)

    # -- the update (worker thread, or inline without offload) -------------------------------

    def _check_and_apply(self, u: UnitBuffers, grads: list[torch.Tensor], finite: torch.Tensor | bool,
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

    def _apply(self, u: UnitBuffers, grads: list[torch.Tensor], hp: AdamConfig) -> None:
        outs = self._outputs(u)
        dst_master, dst_state = u.shadow if self.cfg.exact_skip else (u.master, u.state)
        for i, g in enumerate(grads):
            source = (u.master[i], u.state[i]) if self.cfg.exact_skip else None
            adam_step(dst_master[i], g, dst_state[i], hp, self._steps + 1, out=outs[i], chunk=self.cfg.chunk,
                      source=source, scratch=self._scratch)
        self._upload(u)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Masters, moments and step counts as a flat dict for safetensors: the optimizer's own buffers (on the
        CPU, or the device with ``offload=False``), not copies; keys as ``units.state_entries`` writes them."""
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

