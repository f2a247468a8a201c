"""Splitting a batch tree into micro-batches along one dimension, and joining micro-batch outputs back."""

from __future__ import annotations

from typing import Any

import torch

from d9d.core.pytree.tree import PyTree, tree_flatten, tree_unflatten


def _leaf_paths(tree: PyTree) -> list[str]:
    import torch.utils._pytree as torch_pytree

    return [torch_pytree.keystr(path) or "<root>" for path, _ in torch_pytree.tree_flatten_with_path(tree)[0]]


def split_microbatches(tree: PyTree, num_microbatches: int, *, dim: int = 0) -> list[PyTree]:
    """Split every tensor leaf into `num_microbatches` equal chunks along `dim`; other leaves go to every chunk.

    Raises:
        ValueError: a tensor whose size along `dim` is not divisible, naming its path in the tree.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
    leaves, spec = tree_flatten(tree)
    paths = _leaf_paths(tree)
    chunked: list[list[Any]] = []
    for path, leaf in zip(paths, leaves, strict=True):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() <= dim or leaf.shape[dim] % num_microbatches != 0:
                size = leaf.shape[dim] if leaf.dim() > dim else "absent"
                raise ValueError(
                    f"batch leaf {path} with shape {list(leaf.shape)} cannot be split into {num_microbatches} "
                    f"micro-batches along dim {dim} (size {size}); its size along dim {dim} must be a multiple of "
                    f"{num_microbatches}."
                )
            chunked.append(list(leaf.chunk(num_microbatches, dim=dim)))
        else:
            chunked.append([leaf] * num_microbatches)
    return [tree_unflatten([chunks[index] for chunks in chunked], spec) for index in range(num_microbatches)]


def join_microbatches(microbatches: list[PyTree], *, dim: int = 0) -> PyTree:
    """Concatenate tensor leaves of same-structured trees along `dim`; other leaves must agree and are kept once."""
    if not microbatches:
        raise ValueError("join_microbatches needs at least one micro-batch")
    flattened = [tree_flatten(tree) for tree in microbatches]
    spec = flattened[0][1]
    for index, (_, other) in enumerate(flattened[1:], start=1):
        if other != spec:
            raise ValueError(f"micro-batch {index} has a different structure from micro-batch 0: {other} vs {spec}")
    paths = _leaf_paths(microbatches[0])
    joined: list[Any] = []
    for position, path in enumerate(paths):
        values = [leaves[position] for leaves, _ in flattened]
        if isinstance(values[0], torch.Tensor):
            joined.append(torch.cat(values, dim=dim))
        elif all(value == values[0] for value in values):
            joined.append(values[0])
        else:
            raise ValueError(f"non-tensor leaf {path} differs between micro-batches ({values}); it cannot be joined")
    return tree_unflatten(joined, spec)
