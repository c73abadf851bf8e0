"""The parameter tree: nested dicts and lists of tensors, addressed by dotted paths."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

Tree = Any  # dict[str, Tree] | list[Tree] | torch.Tensor


def tree_map(fn: Callable[[torch.Tensor], Any], tree: Tree) -> Tree:
    if isinstance(tree, dict):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [tree_map(fn, v) for v in tree]
    return fn(tree)


def named_leaves(tree: Tree, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (dotted path, tensor) in a fixed order, e.g. ('blocks.3.qkv_w', t)."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        yield prefix, tree
        return
    for k, v in items:
        yield from named_leaves(v, f"{prefix}.{k}" if prefix else k)


def get_path(tree: Tree, path: str) -> torch.Tensor:
    for part in path.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree


def set_path(tree: Tree, path: str, value: torch.Tensor) -> None:
    *parents, last = path.split(".")
    for part in parents:
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    if isinstance(tree, list):
        tree[int(last)] = value
    else:
        tree[last] = value
