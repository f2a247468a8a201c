"""Thin, typed layer over `torch.utils._pytree`, the tree registry that DTensor, FSDP and pipelining already use.

Using PyTorch's own registry (rather than a second one such as optree) means a container type registered once is
understood by d9d and by PyTorch alike. Dataclasses are registered on first use so batches can be typed records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeAlias

import torch
import torch.utils._pytree as torch_pytree

PyTree: TypeAlias = Any
TreeSpec: TypeAlias = torch_pytree.TreeSpec


def _register_dataclasses(tree: PyTree) -> None:
    """Register every dataclass type found in `tree` as a pytree node (fields in declaration order)."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        cls = type(tree)
        if cls not in torch_pytree.SUPPORTED_NODES:
            names = [field.name for field in dataclasses.fields(cls)]
            torch_pytree.register_pytree_node(
                cls,
                lambda obj: ([getattr(obj, name) for name in names], None),
                lambda values, _context: cls(**dict(zip(names, values, strict=True))),
                serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
                flatten_with_keys_fn=lambda obj: (
                    [(torch_pytree.GetAttrKey(name), getattr(obj, name)) for name in names],
                    None,
                ),
            )
        for field in dataclasses.fields(tree):
            _register_dataclasses(getattr(tree, field.name))
    elif isinstance(tree, dict):
        for value in tree.values():
            _register_dataclasses(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            _register_dataclasses(value)


def tree_flatten(tree: PyTree) -> tuple[list[Any], TreeSpec]:
    _register_dataclasses(tree)
    return torch_pytree.tree_flatten(tree)


def tree_unflatten(leaves: list[Any], spec: TreeSpec) -> PyTree:
    return torch_pytree.tree_unflatten(leaves, spec)


def tree_leaves(tree: PyTree) -> list[Any]:
    return tree_flatten(tree)[0]


def tree_map(function: Callable[[Any], Any], tree: PyTree) -> PyTree:
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([function(leaf) for leaf in leaves], spec)


def tree_map_tensors(function: Callable[[torch.Tensor], Any], tree: PyTree) -> PyTree:
    """Map tensors only; every other leaf (ints, strings, None) is kept as it is."""
    return tree_map(lambda leaf: function(leaf) if isinstance(leaf, torch.Tensor) else leaf, tree)
