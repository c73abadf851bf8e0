"""Batches for a step: blocks of a token stream, or instruction examples one per row, in a seeded order
that a ``DataPosition`` resumes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from nanotrain.data.chat import Example

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), each [batch, seq] int64
# A target that enters no loss (padding, a prompt's tokens): the data says where, the loss leaves it out (the value
# is PyTorch's cross-entropy default, so a reference loss agrees).
IGNORE_INDEX = -100


@dataclass
class DataPosition:
    """Where a run is in its data: enough to resume the exact same batches."""
    epoch: int = 0
    index: int = 0


class _Shuffled:
    """Batches of ``batch`` of ``count`` items in a shuffled order per epoch and seed, which ``position`` resumes;
    an epoch drops its last partial batch. A loader's ``take`` makes a batch of the items of the ids it is given."""
    count: int
    batch: int
    seed: int
    position: DataPosition

    def next_batch(self) -> Batch:
        """(inputs, targets), each [batch, seq] int64."""
        p = self.position
        if p.index + self.batch > self.count:
            p.epoch, p.index = p.epoch + 1, 0
        order = torch.randperm(self.count, generator=torch.Generator().manual_seed(self.seed * 100003 + p.epoch))
        ids = order[p.index:p.index + self.batch]
        p.index += self.batch
        return self.take(ids)

    @property
    def batches_per_epoch(self) -> int:
        return self.count // self.batch

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()


class BlockLoader(_Shuffled):
    """Batches of ``batch`` blocks of ``seq`` tokens (+1 for the shifted targets), shuffled per epoch by seed.

    ``tokens`` may map a file (``token_files.map_tokens``): a batch gathers its blocks' ids and reads
    only their pages.
    """

    def __init__(self, tokens: torch.Tensor, seq: int, batch: int, seed: int = 0):
        self.tokens, self.seq, self.batch, self.seed = tokens, seq, batch, seed
        self.count = (len(tokens) - 1) // seq  # blocks
        if self.count < batch:
            raise ValueError(f"the corpus has {len(tokens)} tokens: {self.count} blocks of {seq}, fewer than "
                             f"one batch of {batch}; use a larger corpus, a shorter --seq or a smaller --batch")
        self.position = DataPosition()

    def take(self, ids: torch.Tensor) -> Batch:
        starts = ids[:, None] * self.seq + torch.arange(self.seq + 1)
        chunk = self.tokens[starts.flatten()].long().view(len(ids), self.seq + 1)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def describe(self) -> str:
        return f"{len(self.tokens):,} tokens ({self.tokens.dtype}), {self.count:,} blocks of {self.seq} an epoch"


class ExampleLoader(_Shuffled):
    """Batches of ``batch`` examples, one per row from position 0, padded on the right to ``seq``.

    Padded rather than packed: without a mask between documents, a packed example would attend to the
    ones before it and start at a later position (GPT-2 learns its positions), so its loss would not
    be its own. A padded row is exactly what inference sees; the padding's targets are ignored and,
    attention being causal, the padding changes nothing before it. The price is compute on padding:
    ``describe`` gives the lengths to pick ``--seq`` by. A longer example is cut to ``seq`` (said by
    ``describe``); one whose answer starts past ``seq`` is refused, having nothing to train.
    """

    def __init__(self, examples: list[Example], seq: int, batch: int, pad_id: int, seed: int = 0):
        if len(examples) < batch:
            raise ValueError(f"{len(examples)} examples, fewer than one batch of {batch}; use a smaller --batch")
        empty = [e.line for e in examples if not e.trained[1:seq + 1].any()]
        if empty:
            raise ValueError(f"{len(empty)} examples have no answer token within --seq {seq} (lines "
                             f"{', '.join(map(str, empty[:5]))}{', ...' if len(empty) > 5 else ''}): raise --seq or "
                             f"shorten their prompts")
        self.examples, self.seq, self.batch, self.pad_id, self.seed = examples, seq, batch, pad_id, seed
        self.count = len(examples)
        self.position = DataPosition()

    def take(self, ids: torch.Tensor) -> Batch:
        inputs = torch.full((len(ids), self.seq), self.pad_id, dtype=torch.int64)
        targets = torch.full((len(ids), self.seq), IGNORE_INDEX, dtype=torch.int64)
        for row, i in enumerate(ids.tolist()):
            ex = self.examples[i]
            n = min(len(ex.ids), self.seq + 1) - 1
            inputs[row, :n] = ex.ids[:n]
            targets[row, :n] = torch.where(ex.trained[1:n + 1], ex.ids[1:n + 1], IGNORE_INDEX)
        return inputs, targets

    def describe(self) -> str:
        lengths = torch.tensor([len(e.ids) for e in self.examples])
        answers = sum(int(e.trained.sum()) for e in self.examples)
        cut = [e for e in self.examples if len(e.ids) > self.seq + 1]
        lost = sum(int(e.trained[self.seq + 1:].sum()) for e in cut)
        padding = 1 - float(lengths.clamp(max=self.seq + 1).sub(1).sum()) / (len(lengths) * self.seq)
        text = (f"{len(lengths):,} examples of {int(lengths.min())}-{int(lengths.max())} tokens (mean "
                f"{float(lengths.float().mean()):.0f}; {answers:,} answer tokens, the only ones trained), padded to "
                f"--seq {self.seq}: {padding:.0%} of the positions are padding")
        if cut:
            text += (f"; {len(cut)} longer than --seq + 1 are cut, {lost} answer tokens not trained (--seq "
                     f"{int(lengths.max()) - 1} keeps all)")
        return text
