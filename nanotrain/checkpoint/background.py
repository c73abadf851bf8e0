"""Saves written while training goes on: the state snapshotted at the step boundary, written by a thread.

``Saver.save`` waits for the write before (one save at a time), takes this rank's half of a save
(``state.snapshot``: device tensors copied to the host, the manifest's lines gathered) and copies what is still
the optimizer's own host buffers (``--states cpu`` and streaming keep the masters and moments there, and the next
update mutates them), then a thread writes the files and publishes as ``state.save_checkpoint`` does: checksums,
the atomic rename and ``latest`` moved last, unchanged, so a crash or ``kill -9`` during a write leaves
``latest`` on the checkpoint before. Where the host has not the memory for that copy (``MemAvailable``, for the
copies of all the ranks on that host together, or the run's ``--host-mem-gib`` less what the process holds), the
save is written at once instead, said in one line.

Across ranks the thread's collectives (every rank's file written, then the publish) run on a gloo group of
their own, made once at the first save (by every rank of the world: ``Saver._writers`` says why): never
interleaved with the training's. A failed write is said at once by the thread and raised (``SaveFailed``) at the
run's next save or at its end (``wait``), at the same point on every rank.
"""
from __future__ import annotations

import socket
import threading
from pathlib import Path

import torch.distributed as dist

from nanotrain.checkpoint.disk import SaveFailed
from nanotrain.checkpoint.state import Snapshot, snapshot
from nanotrain.core.machine import GIB, host_available, host_rss_gib
from nanotrain.core.train.schedule import LRSchedule
from nanotrain.core.train.step import Trainer
from nanotrain.data import DataPosition
from nanotrain.distributed import Group


class Saver:
    """A run's saves into ``run_dir``, each written on a thread while training goes on (keeping ``keep_last``)."""

    def __init__(self, run_dir: Path, keep_last: int = 0, host_cap_gib: float | None = None):
        self.run_dir, self.keep_last, self.host_cap_gib = Path(run_dir), keep_last, host_cap_gib
        self._thread: threading.Thread | None = None
        self._failed: SaveFailed | None = None
        self._side: tuple[Group, Group] | None = None  # (the trainer's group, the writer's gloo group over it)

    def save(self, trainer: Trainer, position: DataPosition | None, meta: dict | None = None,
             schedule: LRSchedule | None = None) -> Path:
        """Start saving ``trainer``'s state (every rank of its group calls it); the folder it will publish."""
        self.wait()
        snap = snapshot(self.run_dir, trainer, position, meta, schedule, self.keep_last)
        if snap.group is not None:
            snap.group = self._writers(snap.group)
        if not _room(snap.live_bytes, snap.group, self.host_cap_gib):
            within = "host memory" if self.host_cap_gib is None else f"host memory (--host-mem-gib {self.host_cap_gib})"
            print(f"note: {snap.live_bytes / 2**30:.2f} GiB of optimizer state would not fit {within} as a copy "
                  f"beside itself; {snap.final.name} is written before training goes on", flush=True)
            return snap.write()
        snap.own()
        self._thread = threading.Thread(target=self._write, args=(snap,), name=f"save-{snap.final.name}")
        self._thread.start()  # not a daemon: the process waits for it at exit whatever ends the run
        return snap.final

    def wait(self) -> None:
        """Wait for the write under way; raise ``SaveFailed`` if it (or one before) failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed

    def _write(self, snap: Snapshot) -> None:
        try:
            snap.write()
        except SaveFailed as e:
            self._failed = e
            print(f"error: {e} (saved in the background; the run stops at its next save or its end)", flush=True)

    def _writers(self, group: Group) -> Group:
        """A gloo group over ``group``'s ranks for the writes' collectives, made once, by every rank of the world.
        Not by ``group``'s ranks alone (``use_local_synchronization``): torch names such a group from how many groups
        each member holds, and a rank in fewer (a middle pipeline stage is in no tied leaf's group) would wait for
        its peers under another name forever."""
        if self._side is None or self._side[0] is not group:
            ranks, world = dist.get_process_group_ranks(group), dist.get_world_size()
            if len(ranks) != world:
                raise ValueError(f"a background save needs every rank of the world, but the trainer's group holds "
                                 f"{len(ranks)} of {world}: save with checkpoint.state.save_checkpoint instead")
            # torch's long default timeout, not the run's (ctx.grid.timeout), on purpose: a rank waits in this group
            # while a peer writes a large shard, which may take minutes
            self._side = (group, dist.new_group(ranks, backend="gloo"))
        return self._side[1]


def _room(nbytes: int, group: Group | None, cap_gib: float | None = None) -> bool:
    """Whether every rank of ``group`` has room for its copy of ``nbytes`` (and 1 GiB to spare): the copies of all the
    ranks on one host together within that host's available memory (each rank alone would count the same free
    memory as its own), and with ``cap_gib`` each rank's copy beside what its process holds now under that cap."""
    under_cap = not nbytes or cap_gib is None or host_rss_gib()[0] * GIB + nbytes + (1 << 30) <= cap_gib * GIB
    mine = (socket.gethostname(), nbytes, host_available(), under_cap)
    every = [mine]
    if group is not None:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
    for host in {h for h, *_ in every}:
        here = [(b, available) for h, b, available, _ in every if h == host]
        need = sum(b for b, _ in here)
        if need and need + (1 << 30) >= min(available for _, available in here):
            return False
    return all(under for *_, under in every)
