"""Staged units: their masters and moments reach the device only chunk by chunk, during their update.

``StreamedAdam`` gives each unit's slot its masters, moments and compute-dtype weights on the device. For
the embedding and the untied head of a large vocabulary that is most of a small GPU: Llama-3.1-8B's two
[128256, 4096] matrices keep 32-bit moments (``ModelSpec.fp32_moments``), 14 bytes a parameter with the
weights, 7.3 GiB each. A staged unit's slot (``OffloadConfig.staged_units``) keeps only the weights (2
bytes a parameter, refreshed by each update), and its update walks the unit in chunks of
``OffloadConfig.stage_numel`` elements through two device buffers:

    upload stream:  chunk j's masters and moments into buffer j % 2, once chunk j - 2 has left it
    update stream:  AdamW on chunk j, the new weights written into the slot (``adam_step(out=)``)
    download stream: chunk j's masters and moments back to host memory

so the upload of one chunk, the update of the one before and the download of the one before that
overlap, and none of it runs on the compute stream: the blocks' backward goes on while the head is
updated. The price is the unit's masters and moments over the host link both ways every step (12
bytes a parameter each way with 32-bit moments), beside the blocks' own traffic, and two staging
buffers of ``stage_numel`` x 12 bytes. On a CPU-only machine the same chunks are copied in order.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from nanotrain.core.optim.adam import AdamConfig, AdamState, AdamState8, AdamState32, adam_step
from nanotrain.core.optim.quant8 import n_blocks
from nanotrain.core.optim.scratch import Scratch
STAGE_BYTES_PER_ELEMENT = 12  # an fp32 master and two fp32 moments: the widest a chunk element can be


def chunk_views(buffer: torch.Tensor, n: int, state: AdamState) -> tuple[torch.Tensor, AdamState]:
    """A master and moments for ``n`` elements carved out of a staging ``buffer`` (bytes) like ``state``."""
    def take(numel: int, dtype: torch.dtype, at: list[int]) -> torch.Tensor:
        size = numel * torch.empty((), dtype=dtype).element_size()
        start = -(-at[0] // 16) * 16
        at[0] = start + size
        return buffer[start:start + size].view(dtype)

    at = [0]
    master = take(n, torch.float32, at)
    if isinstance(state, AdamState8):
        blocks = n_blocks(n, state.block)
        return master, AdamState8(take(n, torch.uint8, at), take(blocks, torch.float32, at), take(n, torch.uint8, at),
                                   take(blocks, torch.float32, at), state.block)
    return master, AdamState32(take(n, torch.float32, at), take(n, torch.float32, at))


def host_chunk(master: torch.Tensor, state: AdamState, lo: int, hi: int) -> tuple[torch.Tensor, AdamState]:
    """Elements ``lo:hi`` of a host master and its moments (``lo`` on a quantization block's start)."""
    if isinstance(state, AdamState8):
        blocks = slice(lo // state.block, n_blocks(hi, state.block))
        return master[lo:hi], AdamState8(state.exp_avg[lo:hi], state.exp_avg_absmax[blocks], state.exp_avg_sq[lo:hi],
                                         state.exp_avg_sq_absmax[blocks], state.block)
    return master[lo:hi], AdamState32(state.exp_avg[lo:hi], state.exp_avg_sq[lo:hi])


def _tensors(master: torch.Tensor, state: AdamState) -> list[torch.Tensor]:
    if isinstance(state, AdamState8):
        return [master, state.exp_avg, state.exp_avg_absmax, state.exp_avg_sq, state.exp_avg_sq_absmax]
    return [master, state.exp_avg, state.exp_avg_sq]


class Stager:
    """The two staging buffers and three streams of every staged unit's updates (one at a time)."""

    def __init__(self, device: torch.device, stage_numel: int, block: int):
        self.device, self._cuda = device, device.type == "cuda"
        self.numel = max(block, stage_numel // block * block)  # chunks cut along quantization blocks
        self.buffers = [torch.empty(self.numel * STAGE_BYTES_PER_ELEMENT + 64, dtype=torch.uint8, device=device)
                        for _ in range(2)]
        self._free: list[torch.cuda.Event | None] = [None, None]
        self._scratch = Scratch()  # the update stream's own: the compute stream's may be in use meanwhile
        self._up = self._run = self._down = None
        if self._cuda:
            self._up, self._run, self._down = (torch.cuda.Stream(device) for _ in range(3))

    def _chunks(self, masters: list[torch.Tensor]):
        """(leaf index, lo, hi, buffer index) of every chunk of the unit, in order."""
        j = 0
        for i, m in enumerate(masters):
            for lo in range(0, m.numel(), self.numel):
                yield i, lo, min(lo + self.numel, m.numel()), j % 2
                j += 1

    @torch.no_grad()
    def refresh(self, masters: list[torch.Tensor], weights: list[torch.Tensor],
                written: torch.cuda.Event | None) -> torch.cuda.Event | None:
        """Cast host ``masters`` (final once ``written`` has happened) into the device ``weights`` chunk by
        chunk; the event that ends it."""
        self._after_compute([])
        self._wait(self._up, written)
        for i, lo, hi, b in self._chunks(masters):
            stage = self.buffers[b][:(hi - lo) * 4].view(torch.float32)
            self._upload([(stage, masters[i][lo:hi])], b)
            with self._on(self._run):
                self._wait(self._run, self._loaded)
                weights[i].view(-1)[lo:hi].copy_(stage)
                self._free[b] = self._record(self._run)
        return self._record(self._run)

    @torch.no_grad()
    def update(self, masters: list[torch.Tensor], states: list[AdamState], grads: list[torch.Tensor],
               weights: list[torch.Tensor], hp: AdamConfig, step: int,
               written: torch.cuda.Event | None) -> tuple[torch.cuda.Event | None, ...]:
        """AdamW step ``step`` of the host ``masters`` and ``states`` (final once ``written`` has happened) with
        device ``grads``, chunk by chunk (see the module docstring); the new weights go into ``weights``.
        Returns the events that end the weights' writing and the host state's."""
        self._after_compute(grads)
        self._wait(self._up, written)
        for i, lo, hi, b in self._chunks(masters):
            host_m, host_s = host_chunk(masters[i], states[i], lo, hi)
            dev_m, dev_s = chunk_views(self.buffers[b], hi - lo, states[i])
            self._upload(list(zip(_tensors(dev_m, dev_s), _tensors(host_m, host_s))), b)
            with self._on(self._run):
                self._wait(self._run, self._loaded)
                adam_step(dev_m, grads[i].view(-1)[lo:hi], dev_s, hp, step, out=weights[i].view(-1)[lo:hi],
                          scratch=self._scratch)
                done = self._record(self._run)
            with self._on(self._down):
                self._wait(self._down, done)
                for h, d in zip(_tensors(host_m, host_s), _tensors(dev_m, dev_s)):
                    h.copy_(d, non_blocking=True)
                self._free[b] = self._record(self._down)
        return self._record(self._run), self._record(self._down)

    def _after_compute(self, grads: list[torch.Tensor]) -> None:
        """Order the update stream after the compute stream's work so far: the gradients are final and earlier
        reads of the weights done; the gradients' memory is not reused before the update has read them."""
        if self._cuda:
            self._run.wait_stream(torch.cuda.current_stream(self.device))
            for g in grads:
                g.record_stream(self._run)

    def _upload(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], b: int) -> None:
        with self._on(self._up):
            self._wait(self._up, self._free[b])
            for d, h in pairs:
                d.copy_(h, non_blocking=True)
            self._loaded = self._record(self._up)

    def _on(self, stream):
        return torch.cuda.stream(stream) if self._cuda else nullcontext()

    def _wait(self, stream, event: torch.cuda.Event | None) -> None:
        if self._cuda and event is not None:
            stream.wait_event(event)

    def _record(self, stream) -> torch.cuda.Event | None:
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

