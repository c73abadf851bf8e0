"""Weight streaming under data parallelism (ZeRO-Offload): each rank keeps 1/N of the masters and moments.

Every rank runs a ``StreamTrainer`` on its rows of each global batch (``DataParallelTrainer``
splits them; dropout seeds follow the global micro-batch index) with ``ShardedStreamedAdam`` as
its optimizer. Each unit (the embeddings, a block, the head) is laid out as one flat vector padded to
a multiple of the world size (``buckets.py``), and rank ``r`` keeps only shard ``r`` of its fp32 masters
and Adam moments in host memory, so that part of host memory shrinks with N. Per unit and step:

- forward, and backward before the update: the unit's whole weights in the compute dtype arrive
  from a host copy that every rank keeps (locked, 2 bytes a parameter in bf16: the part that does
  not shrink with N; in exchange a unit arrives with one copy, not a gather over the ranks twice a
  step, and the device holds whole weights only for the units being computed);
- when its gradient is final in backward (when one process would update it): the fp32 gradient,
  laid out as the unit's flat vector, is reduce-scattered so each rank holds the sum of its shard,
  the rank's shard of masters and moments comes to the device and is updated there
  (``StreamedAdam`` over the shard), the new masters are cast to the compute dtype and all-gathered
  into the slot, and the slot's whole new weights go back to the host copy.

The shard is cut into pieces as ``shards.py`` cuts a bucket's, each a parameter of the inner
``StreamedAdam`` with the moment bits (and 8-bit blocks) its parameter has in one process.

The collectives are waited for on the device (NCCL: the host does not block); the next block's
backward waits for them: overlapping them with compute is not built yet. With clipping or fp16 the
updates wait for the step's verdict, each unit's reduced shard kept in host memory (``deferred.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanotrain.data_parallel import comms
from nanotrain.data_parallel.buckets import Bucket, plan_buckets, rank_pieces
from nanotrain.stream.sharded_deferred import ShardedKeptGrads
from nanotrain.data_parallel.shards import pieces_config, whole_entries, whole_state
from nanotrain.core.train.shard import ShardState, moment_block
from nanotrain.distributed import Group
from nanotrain.stream.pinned import HostArena
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.optim.carrier import Wraps
from nanotrain.stream.optimizer import StreamedAdam
from nanotrain.stream.units import Slot
from nanotrain.core.optim.units import resolve_device
from nanotrain.core.leaves import Start, as_leaves


@dataclass
class ShardSlot:
    """Device buffers for one unit at a time: its whole weights, and in ``inner`` the rank's shard of its
    masters and moments."""
    layout: tuple
    flat: torch.Tensor              # the unit's flat padded vector in the compute dtype
    weights: list[torch.Tensor]     # its parameters, shaped: views of ``flat`` that take gradients
    inner: Slot
    unit: str | None = None
    holds: str | None = None        # whose current weights ``flat`` holds (no copy needed to use them)
    ready: torch.cuda.Event | None = None
    free: torch.cuda.Event | None = None


def _layout(b: Bucket) -> tuple:
    return b.offsets, b.shapes, b.padded


class ShardedStreamedAdam(Wraps):
    """``StreamedAdam``'s interface for ``StreamTrainer``, with the state sharded over the data-parallel ``group``.

    ``params`` (the leaves to start from, ``core.leaves.Leaves``, or a tree emptied as it is taken) are taken in
    unit by unit, in forward order, as ``StreamedAdam`` takes them, and replaced by the group's first rank's values.
    """

    def __init__(self, params: Start, units: dict[str, list[str]], hp: AdamConfig, cfg: OffloadConfig,
                 group: Group):
        self.cfg, self.group = cfg, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = resolve_device(cfg)
        self._cuda = self.device.type == "cuda"
        leaves = as_leaves(params)
        self.buckets = plan_buckets(units, {p: torch.Size(s) for p, s in leaves.shapes.items()}, 0, self.world,
                                    moment_block(cfg) or 1)
        self.bucket = {b.units[0]: b for b in self.buckets}
        self.pieces = {b.units[0]: rank_pieces(b, self.rank) for b in self.buckets}
        self.layout = [(b, self.pieces[b.units[0]]) for b in self.buckets]
        self._host: dict[str, torch.Tensor] = {}  # each unit's whole weights in the compute dtype
        self._arenas: list[HostArena] = []
        shards = {}
        for b, pieces in reversed(self.layout):  # the buckets run backward's order; leaves are read in forward's
            flat = b.flatten({path: leaves.read(path) for path in b.paths})  # read, copied in and let go of
            comms.broadcast_from_first([flat], group, self.device)
            lo = b.shard_range(self.rank)[0]
            for p in pieces:
                shards[p.name] = flat[lo + p.lo:lo + p.hi].clone()
            arena = HostArena(HostArena.size_of([(b.padded, cfg.dtype)]), pin=self._cuda)
            self._host[b.units[0]] = arena.take(b.padded, cfg.dtype).copy_(flat)
            self._arenas.append(arena)
        self.inner = StreamedAdam(shards, {u: [p.name for p in ps] for u, ps in self.pieces.items()}, hp,
                                  pieces_config(cfg, self.layout))
        self.clock = self.inner.clock
        self._slots: list[ShardSlot] = []
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._written: dict[str, torch.cuda.Event] = {}  # a unit's last update is back in its host copy
        if self._cuda:
            self._h2d, self._d2h = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)

    # -- device slots, as StreamedAdam's -----------------------------------------------------

    def new_slot(self, unit: str) -> ShardSlot:
        """Device buffers that can hold ``unit`` and any unit of the same layout."""
        b = self.bucket[unit]
        flat = torch.zeros(b.padded, dtype=self.cfg.dtype, device=self.device)
        weights = [v.detach().requires_grad_() for v in b.views(flat).values()]
        slot = ShardSlot(_layout(b), flat, weights, self.inner.new_slot(unit))
        self._slots.append(slot)
        return slot

    def fetch(self, unit: str, slot: ShardSlot, states: bool = False) -> None:
        """Start copying ``unit``'s weights (and this rank's shard of its masters and moments) into ``slot``."""
        if _layout(self.bucket[unit]) != slot.layout:
            raise ValueError(f"unit {unit!r} does not fit this slot (made for another layout); make one with "
                             f"new_slot({unit!r})")
        slot.unit = unit
        if slot.holds != unit:
            slot.holds = unit
            if not self._cuda:
                slot.flat.copy_(self._host[unit])
            else:
                with torch.cuda.stream(self._h2d):
                    for event in (slot.free, self._written.get(unit)):
                        if event is not None:
                            self._h2d.wait_event(event)
                    slot.flat.copy_(self._host[unit], non_blocking=True)
                    slot.ready = torch.cuda.Event()
                    slot.ready.record(self._h2d)
        if states:
            self.inner.fetch(unit, slot.inner, states=True)

    def weights(self, slot: ShardSlot) -> list[torch.Tensor]:
        """The slot's unit in the compute dtype, shaped, ready on the current stream."""
        self.clock.wait(slot.ready)
        return slot.weights

    def release(self, slot: ShardSlot) -> None:
        if self._cuda:
            slot.free = torch.cuda.Event()
            slot.free.record(torch.cuda.current_stream(self.device))
        self.inner.release(slot.inner)

    def _scratch(self, b: Bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The flat fp32 gradient, its reduced shard and the new weights' shard, shared by units of one
        layout (their padding stays zero: only the parameters' places are ever written)."""
        if _layout(b) not in self._buffers:
            dev = self.device
            self._buffers[_layout(b)] = (torch.zeros(b.padded, device=dev), torch.zeros(b.shard, device=dev),
                                         torch.zeros(b.shard, dtype=self.cfg.dtype, device=dev))
        return self._buffers[_layout(b)]

    def update(self, slot: ShardSlot, grads: list[torch.Tensor]) -> None:
        """Reduce-scatter the unit's gradient ``grads`` (this rank's part of the batch), AdamW on this rank's
        shard, and all-gather the new weights into the slot and its host copy."""
        self.apply(slot, self.reduce(slot.unit, grads))

    def reduce(self, unit: str, grads: list[torch.Tensor]) -> torch.Tensor:
        """This rank's shard of ``unit``'s gradient ``grads`` summed over the group, in ``shard_buffer(unit)``."""
        b = self.bucket[unit]
        flat, shard, _ = self._scratch(b)
        with torch.no_grad():
            for view, g in zip(b.views(flat).values(), grads):
                view.copy_(g)
            comms.reduce_scatter_async(shard, flat, self.group).wait()
        return shard

    def shard_buffer(self, unit: str) -> torch.Tensor:
        """The device buffer of ``unit``'s reduced gradient shard (shared by the units of its layout)."""
        return self._scratch(self.bucket[unit])[1]

    def apply(self, slot: ShardSlot, shard: torch.Tensor) -> None:
        """AdamW on this rank's shard of the slot's unit with the reduced gradient ``shard``, and all-gather
        the new weights into the slot and its host copy."""
        unit = slot.unit
        pieces, low = self.pieces[unit], self._scratch(self.bucket[unit])[2]
        with torch.no_grad():
            self.inner.update(slot.inner, [shard[p.lo:p.hi] for p in pieces], [low[p.lo:p.hi] for p in pieces])
            # The slot's last copy to the host is done reading it, and a fetch of its old weights is done
            # writing it (a deferred step fetches units for their update without computing with them).
            self.clock.wait(self._written.get(unit))
            self.clock.wait(slot.ready)
            comms.all_gather_async(slot.flat, low, self.group).wait()
        for other in self._slots:  # another slot's copy of the unit is stale now
            if other.holds == unit:
                other.holds = None
        slot.holds = unit
        if not self._cuda:
            self._host[unit].copy_(slot.flat)
            return
        compute = torch.cuda.current_stream(self.device)  # read outside: inside, it is the side stream
        with torch.cuda.stream(self._d2h):
            self._d2h.wait_stream(compute)
            self._host[unit].copy_(slot.flat, non_blocking=True)
            slot.free = self._written[unit] = torch.cuda.Event()
            slot.free.record(self._d2h)

    def kept_grads(self, on_host: list[str]) -> ShardedKeptGrads:
        """Where a deferred step (clipping, fp16) keeps its gradients: every unit's reduced shard in host
        memory, not only those of ``on_host`` (``deferred.py``)."""
        return ShardedKeptGrads(self)

    def step_loss(self, total: torch.Tensor) -> float:
        """The whole batch's loss, every rank's part summed: every rank skips a non-finite step alike."""
        return comms.sum_value(total.item(), self.group, self.device)

    def finish_step(self, skipped: bool) -> None:
        self.inner.finish_step(skipped)

    def check_replicas(self) -> None:
        """Raise if any rank's weights differ from the first rank's (debug: costs a broadcast of the model)."""
        self.synchronize()
        for unit, host in self._host.items():
            if comms.differs_from_first(host.to(self.device), self.group):
                raise RuntimeError(f"data-parallel replicas differ: unit {unit!r} on some rank is not the first "
                                   f"rank's")

    # -- checkpoints ------------------------------------------------------------------------

    def shard_state(self) -> ShardState:
        """This rank's pieces of masters and moments (``slices.py``)."""
        self.synchronize()
        return ShardState([p for _, ps in self.layout for p in ps], self.inner.state_dict(), moment_block(self.cfg))

    def load_shard_state(self, entries: dict[str, torch.Tensor]) -> None:
        self.synchronize()
        self.inner.load_state_dict(entries)
        self._weights_from_masters()

    def _weights_from_masters(self) -> None:
        """Every unit's whole weights, cast from the loaded masters and gathered over the ranks."""
        for b, pieces in self.layout:
            low = torch.zeros(b.shard, dtype=self.cfg.dtype)
            for p, master in zip(pieces, self.inner.units[b.units[0]].master):
                low[p.lo:p.hi] = master
            self._host[b.units[0]].copy_(comms.gather_flat(low, self.group, self.device))
        for slot in self._slots:
            slot.holds = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The single-process state, gathered (collective) onto the group's first rank; {} on the others."""
        self.synchronize()
        return whole_state(self.inner.state_dict(), self.layout, self.group, self.device, self.rank == 0)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load a single-process state (the same on every rank), saved at any world size."""
        self.load_shard_state(whole_entries(self.shard_state(), sd))

    def host_bytes(self) -> tuple[int, int]:
        """Host bytes of (this rank's masters and moments, the whole weights' copy)."""
        return (sum(u.arena.buffer.numel() for u in self.inner.units.values()),
                sum(a.buffer.numel() for a in self._arenas))

    def close(self) -> None:
        super().close()
        for arena in self._arenas:
            arena.close()
