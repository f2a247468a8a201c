"""Nested batches (dicts, lists, tuples, dataclasses of tensors): flatten, map, split into micro-batches, join."""

from d9d.core.pytree.microbatch import join_microbatches, split_microbatches
from d9d.core.pytree.tree import PyTree, TreeSpec, tree_flatten, tree_leaves, tree_map, tree_map_tensors, tree_unflatten

__all__ = [
    "PyTree",
    "TreeSpec",
    "join_microbatches",
    "split_microbatches",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_map_tensors",
    "tree_unflatten",
]
