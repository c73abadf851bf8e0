"""Buckets' flat layout: every parameter where ``offsets`` says, aligned as asked, and ``gaps`` exactly what no
parameter covers (ZeRO-3 writes a unit's first gradient into the parameters' views and zeroes only the gaps)."""
import torch

from nanotrain.data_parallel.buckets import plan_buckets


def test_gaps_are_exactly_what_no_parameter_covers():
    shapes = {"a.w": torch.Size([5, 3]), "a.b": torch.Size([7]), "b.w": torch.Size([11])}
    units = {"a": ["a.w", "a.b"], "b": ["b.w"]}
    for world, align in ((1, 1), (3, 1), (3, 8), (2, 16)):
        for b in plan_buckets(units, shapes, 0, world, align):
            covered = torch.zeros(b.padded, dtype=torch.int32)
            for view in b.views(covered).values():
                view += 1
            for lo, hi in b.gaps():
                covered[lo:hi] += 1
            assert torch.equal(covered, torch.ones_like(covered)), (world, align, b.name, b.gaps())
            assert all(o % align == 0 for o in b.offsets) and b.shard % align == 0 and b.padded % world == 0
