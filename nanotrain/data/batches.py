"""Batches for a step: blocks of a token stream, or instruction examples one per row, or examples (or text
documents) packed several to a row, in a seeded order that a ``DataPosition`` resumes.

Packed rows (``PackedLoader``): each example attends only to itself and starts at position 0
(``core.models.documents`` says how the engines read it). A row is filled with the examples of a seeded
order, one after another, while the next still fits (next-fit: an example is never split across rows);
the rest of the row is padding, one more document whose targets are ignored. An example longer than
``seq + 1`` ids is cut to its first ``seq + 1`` (a row of its own, as the padded loader cuts it; ``describe``
counts the answer tokens this loses). A text document is an example whose every token is trained (its
end-of-text included); one longer than ``seq + 1`` ids is cut into pieces of ``seq + 1`` overlapping by one
id (each target trained once), each a document from position 0, as ``BlockLoader`` trains its blocks.
Rows are made once, from the seed: epochs shuffle rows, not their contents, so ``DataPosition`` resumes
them as it resumes blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from nanotrain.data.chat import Example

# (inputs, targets), each [batch, seq] int64, and for packed rows each token's position in its document (a
# trainer's ``step(*batch)`` takes them: ``core.models.documents``)
Batch = tuple[torch.Tensor, ...]
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
        """(inputs, targets), each [batch, seq] int64; packed: and the positions."""
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
        check_answers(examples, seq)
        self.examples, self.seq, self.batch, self.pad_id, self.seed = examples, seq, batch, pad_id, seed
        self.count = len(examples)
        self.position = DataPosition()

    def take(self, ids: torch.Tensor) -> Batch:
        return fill_rows(self.examples, [[i] for i in ids.tolist()], self.seq, self.pad_id)[:2]

    def describe(self) -> str:
        return describe_examples(self.examples, self.seq, f"padded to --seq {self.seq}", len(self.examples), self.batch)


def fill_rows(examples: list[Example], rows: list[list[int]], seq: int, pad_id: int) -> Batch:
    """(inputs, targets, positions) ``[len(rows), seq]``: each row the examples it names one after another (each cut
    to ``seq + 1`` ids), their next ids as targets where those are answers', positions from 0 in each, and after them
    padding (``pad_id``, no targets), whose positions count from 0 as one more document."""
    inputs = torch.full((len(rows), seq), pad_id, dtype=torch.int64)
    targets = torch.full((len(rows), seq), IGNORE_INDEX, dtype=torch.int64)
    positions = torch.empty((len(rows), seq), dtype=torch.int64)
    for row, items in enumerate(rows):
        at = 0
        for i in items:
            ex = examples[i]
            n = min(len(ex.ids), seq + 1) - 1
            inputs[row, at:at + n] = ex.ids[:n]
            targets[row, at:at + n] = torch.where(ex.trained[1:n + 1], ex.ids[1:n + 1], IGNORE_INDEX)
            positions[row, at:at + n] = torch.arange(n)
            at += n
        positions[row, at:] = torch.arange(seq - at)
    return inputs, targets, positions


def check_answers(examples: list[Example], seq: int) -> None:
    """Refuse examples with nothing to train within ``seq`` inputs (their first ``seq + 1`` ids)."""
    empty = [e.line for e in examples if not e.trained[1:seq + 1].any()]
    if empty:
        raise ValueError(f"{len(empty)} examples have no answer token within --seq {seq} (lines "
                         f"{', '.join(map(str, empty[:5]))}{', ...' if len(empty) > 5 else ''}): raise --seq or "
                         f"shorten their prompts")


def describe_examples(examples: list[Example], seq: int, how: str, rows: int, batch: int) -> str:
    """The examples' lengths and answer tokens, how they are laid out (``how``) in ``rows`` rows of ``seq``, the share
    of padding, the answer tokens a step of ``batch`` rows trains on average, and what a cut to ``seq + 1`` ids
    loses."""
    lengths = torch.tensor([len(e.ids) for e in examples])
    answers = sum(int(e.trained.sum()) for e in examples)
    cut = [e for e in examples if len(e.ids) > seq + 1]
    lost = sum(int(e.trained[seq + 1:].sum()) for e in cut)
    padding = 1 - float(lengths.clamp(max=seq + 1).sub(1).sum()) / (rows * seq)
    text = (f"{len(lengths):,} examples of {int(lengths.min())}-{int(lengths.max())} tokens (mean "
            f"{float(lengths.float().mean()):.0f}; {answers:,} answer tokens, the only ones trained), {how}: "
            f"{padding:.0%} of the positions are padding, about {(answers - lost) * batch // rows:,} answer tokens "
            f"a step")
    if cut:
        text += (f"; {len(cut)} longer than --seq + 1 are cut, {lost} answer tokens not trained (--seq "
                 f"{int(lengths.max()) - 1} keeps all)")
    return text


def next_fit(lengths: list[int], seq: int) -> list[list[int]]:
    """Rows of item indices, in the given order, each row's lengths summing to at most ``seq``."""
    rows, room = [], 0
    for i, n in enumerate(lengths):
        if not rows or n > room:
            rows.append([])
            room = seq
        rows[-1].append(i)
        room -= n
    return rows


def text_documents(tokens: torch.Tensor, eot: int, seq: int) -> list[Example]:
    """A token stream's documents (each ending at its end-of-text id ``eot``), every token trained, those longer than
    ``seq + 1`` ids cut into pieces of ``seq + 1`` that overlap by one id."""
    ends = (tokens == eot).nonzero().flatten().add(1).tolist()
    if not ends or ends[-1] != len(tokens):
        ends.append(len(tokens))
    docs, start = [], 0
    for end in ends:
        for at in range(start, max(end - 1, start + 1), seq):
            ids = tokens[at:min(at + seq + 1, end)].long()
            if len(ids) > 1:
                docs.append(Example(ids, torch.ones(len(ids), dtype=torch.bool), len(docs) + 1))
        start = end
    return docs


class PackedLoader(_Shuffled):
    """Batches of ``batch`` packed rows of ``seq`` tokens: (inputs, targets, positions), each ``[batch, seq]`` int64.

    ``examples``: instruction examples (their answer tokens trained) or ``text_documents``. Their order into rows
    is a permutation drawn from ``seed``; the rows' order per epoch another (``_Shuffled``).
    """

    def __init__(self, examples: list[Example], seq: int, batch: int, pad_id: int, seed: int = 0):
        check_answers(examples, seq)
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
        self.examples = [examples[i] for i in order]
        rows = next_fit([min(len(e.ids), seq + 1) - 1 for e in self.examples], seq)
        if len(rows) < batch:
            raise ValueError(f"{len(examples)} examples pack into {len(rows)} rows of --seq {seq}, fewer than one "
                             f"batch of {batch}; use a smaller --batch or --seq (or --no-pack)")
        self.rows, self.seq, self.batch, self.pad_id, self.seed = rows, seq, batch, pad_id, seed
        self.count = len(rows)
        self.position = DataPosition()

    def take(self, ids: torch.Tensor) -> Batch:
        return fill_rows(self.examples, [self.rows[r] for r in ids.tolist()], self.seq, self.pad_id)

    def describe(self) -> str:
        how = f"packed into {len(self.rows):,} rows of --seq {self.seq} (each attending only to itself)"
        return describe_examples(self.examples, self.seq, how, len(self.rows), self.batch)
