"""AdamW for weight streaming: fp32 masters and moments in host memory, each update on the device.

``nanotrain.stream.trainer`` brings every unit (the embedding, a block, the head) to the device
twice a step: for the forward pass (weights only) and for its backward pass, after which its
gradient is final and it is updated at once, on the device, and sent back. The update runs on the
device because 8-bit moments, which a 16 GiB host needs for GPT-2-XL, cost the CPU ~1.6 ns per
parameter to dequantize and requantize (16 cores): 2.4 s a step, more than the GPU's whole backward.

Each unit's masters and moments live in one ``HostArena``; a ``Slot`` (device buffers for one unit's
masters, moments and weights) serves every unit of its layout, so the device holds a few units
whatever the depth. Copies run on two side streams, ordered by events, never by host syncs:

- ``fetch(unit, slot)`` copies the unit in on the upload stream, once the slot's previous user is
  done with it and the unit's last update has been copied back; nothing, if the slot still holds
  it (a unit with a slot of its own is updated there and read there again next step);
- ``weights(slot)`` makes the compute stream wait for that copy (the wait is timed, see
  ``WaitClock``) and casts the masters to the compute dtype;
- ``update(slot, grads)`` runs AdamW on the compute stream and copies masters and moments back
  on the download stream; ``release(slot)`` frees a slot that was only read.

A staged unit (``OffloadConfig.staged_units``: the embedding and head of a large vocabulary) keeps only
its weights in its slot; its masters and moments pass through a staging buffer during its update
(``stream.staged``). On a CPU-only machine the "device" is the CPU, the copies are plain copies and
nothing waits.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from nanotrain.core.leaves import Leaves, Start, as_leaves
from nanotrain.core.nf4 import NF4Tensor, nf4_sizes, quantize_nf4
from nanotrain.core.optim.adam import AdamConfig, adam_step
from nanotrain.stream.kept import KeptGrads
from nanotrain.stream.units import HostUnit, Slot, host_parts, like_state, state_sizes, state_tensors, zero_state
from nanotrain.stream.staged import Stager
from nanotrain.core.optim.units import OffloadConfig, check_units, load_entries, resolve_device, state_entries
from nanotrain.core.optim.scratch import Scratch
from nanotrain.stream.pinned import WaitClock, HostArena


class StreamedAdam:
    """AdamW over a parameter tree whose masters and moments stay in host memory between updates.

    ``params``: the leaves to start from (``core.leaves.Leaves``: read from a checkpoint or made from a seed as they
    are taken; or a tree of float tensors, each removed from it once taken), taken unit by unit into host arenas:
    a unit's leaves are read one at a time and let go of once kept, so the host holds the arenas filled so far and
    one leaf in flight (``core.leaves.load_peak``). ``cfg`` is the ``OffloadConfig`` of the non-streaming optimizer
    (device, compute dtype, moment bits, which leaves keep 32-bit moments); its ``offload`` and ``exact_skip`` do not
    apply here. ``frozen``: leaves that only travel with their unit, in the compute dtype or (``nf4``) in NF4 (a base
    under adapters), quantised on the device as they are taken.
    """

    def __init__(self, params: Start, units: dict[str, list[str]], hp: AdamConfig, cfg: OffloadConfig,
                 frozen: frozenset[str] = frozenset(), nf4: frozenset[str] = frozenset()):
        if cfg.exact_skip:
            raise ValueError("StreamedAdam has no exact_skip: the streaming trainer checks the loss before any "
                             "update, so a non-finite loss skips the step exactly anyway")
        self.hp, self.cfg = hp, cfg
        self.device = resolve_device(cfg)
        self._cuda = self.device.type == "cuda"
        leaves = as_leaves(params)
        check_units(units, leaves.shapes, cfg.keep_32bit)
        if unknown := sorted(set(cfg.staged_units) - set(units)):
            raise ValueError(f"staged_units names {unknown}, which are not units (units: {list(units)[:4]} ...)")
        self.units = {name: self._host_unit(name, paths, leaves, frozen, nf4) for name, paths in units.items()}
        self._stager = Stager(self.device, cfg.stage_numel, cfg.block) if cfg.staged_units else None
        if self._cuda:
            self._h2d, self._d2h = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        self.clock = WaitClock(self.device)
        self._scratch = Scratch()
        self._slots: list[Slot] = []
        self.steps, self.skipped_steps = 0, 0

    def _host_unit(self, name: str, paths: list[str], leaves: Leaves, frozen: frozenset[str],
                   nf4: frozenset[str]) -> HostUnit:
        """The unit's arena, carved from the leaves' shapes, then each leaf read into it: a master widened to fp32,
        a frozen leaf cast to the compute dtype or quantised where the compute is (one matrix at a time)."""
        cfg = self.cfg
        shapes = {p: torch.Size(leaves.shapes[p]) for p in paths}
        trained = [p for p in paths if p not in frozen]
        numels = [shapes[p].numel() for p in trained]
        bits = [cfg.moment_bits(p, n) for p, n in zip(trained, numels)]
        parts = {p: nf4_sizes(shapes[p].numel()) if p in nf4 else [(shapes[p].numel(), cfg.dtype)]
                 for p in paths if p in frozen}
        sizes = [(n, torch.float32) for n in numels]
        sizes += [size for p_sizes in parts.values() for size in p_sizes]
        sizes += [size for n, b in zip(numels, bits) for size in state_sizes(n, b, cfg.block)]
        arena = HostArena(HostArena.size_of(sizes), pin=self._cuda)  # carved in ``sizes``' order
        master = dict(zip(trained, (arena.take(n, torch.float32) for n in numels)))
        kept = {p: [arena.take(n, dtype) for n, dtype in p_sizes] for p, p_sizes in parts.items()}
        for p in paths:
            t = leaves.read(p).detach()
            if p in master:
                master[p].copy_(t.reshape(-1))
            else:
                stored = quantize_nf4(t.to(self.device)).parts if p in nf4 else (t,)
                for into, part in zip(kept[p], stored):
                    into.copy_(part.reshape(-1))
            del t
        # the moments' pages last, once a tree held whole has let go of the unit's leaves
        state = [zero_state(arena.take, n, b, cfg.block) for n, b in zip(numels, bits)]
        base = [(i, shapes[p], NF4Tensor(*kept[p][:3], kept[p][3].view(()), shapes[p]) if p in nf4 else kept[p][0])
                for i, p in enumerate(paths) if p in frozen]
        return HostUnit(name, trained, [shapes[p] for p in trained], arena, list(master.values()), state, base=base)

    # -- device slots ------------------------------------------------------------------------

    def new_slot(self, unit: str) -> Slot:
        """Device buffers that can hold ``unit`` and any unit of the same layout."""
        u, dev = self.units[unit], self.device
        trained = set(u.trained_at)
        weights = [torch.empty(shape, dtype=self.cfg.dtype, device=dev).requires_grad_(i in trained)
                   for i, shape in enumerate(u.leaf_shapes)]
        for i, _, host in u.base:  # a 4-bit base arrives in NF4, dequantised at each matmul (``core.nf4``)
            if isinstance(host, NF4Tensor):
                weights[i] = host.to(dev).empty_like()
        if unit in self.cfg.staged_units:
            slot = Slot(u.layout, [], [], weights, staged=True)
        else:
            master = [torch.empty(m.numel(), dtype=torch.float32, device=dev) for m in u.master]
            state = [like_state(s, lambda t: torch.empty(t.shape, dtype=t.dtype, device=dev)) for s in u.state]
            slot = Slot(u.layout, master, state, weights)
        self._slots.append(slot)
        return slot

    def _check_fits(self, u: HostUnit, slot: Slot) -> None:
        if u.layout != slot.layout or slot.staged != (u.name in self.cfg.staged_units):
            raise ValueError(f"unit {u.name!r} does not fit this slot (made for another layout); make one with "
                             f"new_slot({u.name!r})")

    def fetch(self, unit: str, slot: Slot, states: bool = False) -> None:
        """Start copying ``unit``'s masters (and moments) into ``slot``, unless the slot holds them already."""
        u = self.units[unit]
        self._check_fits(u, slot)
        if slot.staged:  # its weights stay; only a checkpoint's or the first fetch casts them anew
            if not slot.current:
                slot.ready = self._stager.refresh(u.master, slot.weights, u.written)
                slot.current = True
            slot.unit = u
            return
        pairs = []
        if slot.master_of is not u:  # a frozen base travels with the masters
            pairs += list(zip(slot.master, u.master))
            pairs += [(d.view(-1), h) for i, _, host in u.base for d, h in zip(host_parts(slot.weights[i]),
                                                                                  host_parts(host))]
            slot.master_of = u
        if states and slot.state_of is not u:
            pairs += [(d, h) for ds, hs in zip(slot.state, u.state)
                      for d, h in zip(state_tensors(ds), state_tensors(hs))]
            slot.state_of = u
        slot.unit = u
        if not pairs:
            return
        if not self._cuda:
            for d, h in pairs:
                d.copy_(h)
            return
        with torch.cuda.stream(self._h2d):
            for event in (slot.free, u.written):
                if event is not None:
                    self._h2d.wait_event(event)
            for d, h in pairs:
                d.copy_(h, non_blocking=True)
            slot.ready = torch.cuda.Event()
            slot.ready.record(self._h2d)

    def weights(self, slot: Slot) -> list[torch.Tensor]:
        """The slot's unit in the compute dtype, shaped, ready on the current stream."""
        self.clock.wait(slot.ready)
        if slot.staged:
            return slot.weights
        with torch.no_grad():
            for i, m in zip(slot.unit.trained_at, slot.master):
                slot.weights[i].view(-1).copy_(m)
        return slot.weights

    def release(self, slot: Slot) -> None:
        """The compute stream is done reading ``slot``: the next ``fetch`` into it may start."""
        if self._cuda:
            slot.free = torch.cuda.Event()
            slot.free.record(torch.cuda.current_stream(self.device))

    def update(self, slot: Slot, grads: list[torch.Tensor], outs: list[torch.Tensor] | None = None) -> None:
        """AdamW step ``steps + 1`` of the slot's unit (masters and moments loaded) with ``grads``, then
        copy it back to host memory. Call ``finish_step`` once every unit has been updated. ``outs``
        receive the new masters cast to their dtype, before the slot may be loaded again."""
        u = slot.unit
        if u is None:
            raise RuntimeError("update of an empty slot: fetch(unit, slot, states=True) first")
        if slot.staged:
            if outs is not None:
                raise ValueError(f"unit {u.name!r} is staged: its update writes the slot's weights, not outs")
            slot.ready, u.written = self._stager.update(u.master, u.state, grads, slot.weights, self.hp,
                                                        self.steps + 1, u.written)
            return
        self.clock.wait(slot.ready)
        if slot.master_of is not u or slot.state_of is not u:
            raise RuntimeError(f"update of {u.name!r} without its masters and moments in the slot: "
                               f"fetch({u.name!r}, slot, states=True) first")
        for i, g in enumerate(grads):
            adam_step(slot.master[i], g, slot.state[i], self.hp, self.steps + 1, chunk=self.cfg.chunk,
                      out=None if outs is None else outs[i], scratch=self._scratch)
        pairs = list(zip(u.master, slot.master))
        pairs += [(h, d) for hs, ds in zip(u.state, slot.state) for h, d in zip(state_tensors(hs), state_tensors(ds))]
        if not self._cuda:
            for h, d in pairs:
                h.copy_(d)
            return
        # The compute stream is read before entering the side stream: inside it, current_stream() *is*
        # the side stream, and waiting on it would not order the copy after the update.
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._d2h):
            self._d2h.wait_stream(compute)
            for h, d in pairs:
                h.copy_(d, non_blocking=True)
            u.written = torch.cuda.Event()
            u.written.record(self._d2h)
            slot.free = u.written

    def kept_grads(self, on_host: list[str]) -> KeptGrads:
        """Where a deferred step (clipping, fp16) keeps its gradients: those of the units ``on_host`` in host
        memory, every other unit's in the trainer's device buffers."""
        return KeptGrads(self, {name: [m.numel() for m in self.units[name].master] for name in on_host})

    def step_loss(self, total: torch.Tensor) -> float:
        """The step's loss (``total`` summed on the device), read before any update decides on a skip."""
        return total.item()

    def set_lr(self, lr: float) -> None:
        """The learning rate of the updates from now on (each runs on the calling thread)."""
        self.hp = replace(self.hp, lr=lr)

    def finish_step(self, skipped: bool) -> None:
        if skipped:
            self.skipped_steps += 1
        else:
            self.steps += 1

    def synchronize(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)

    # -- checkpoints (the same keys as OffloadAdam, so either trainer resumes the other's) ------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Masters, moments and step counts as a flat dict of (host) tensors, ready for safetensors."""
        self.synchronize()
        out = {"steps": torch.tensor(self.steps), "skipped_steps": torch.tensor(self.skipped_steps)}
        for u in self.units.values():
            for path, shape, m, st in zip(u.paths, u.shapes, u.master, u.state):
                out.update(state_entries(path, shape, m, st))
        return out

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.steps, self.skipped_steps = load_entries(self.state_dict(), sd)
        for slot in self._slots:  # what they hold is no longer current
            slot.master_of = slot.state_of = None
            slot.current = False

    def close(self) -> None:
        self.synchronize()
        for u in self.units.values():
            u.arena.close()
