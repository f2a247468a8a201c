"""Static copies of a step's micro-batches, for replaying captured actions (design note 0028).

A CUDA graph reads fixed addresses, so the batch tensors a captured forward reads must live in buffers that each step
refills. A batch is flattened with `d9d.core.pytree` (PyTorch's `torch.utils._pytree` registry, dataclasses
registered on first use); its signature is the tree structure, each tensor leaf's shape and dtype and every other
leaf's value. Two steps with equal signatures can share one capture: the tensor leaves are copied into the static
buffers, the other leaves are the same by construction. `signature_mismatch` says in one line why two differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from d9d.core.pytree import TreeSpec, tree_flatten, tree_unflatten


@dataclass(frozen=True)
class TensorLeaf:
    """What a captured graph fixes about a tensor leaf: its shape and dtype (its values are copied each step)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class MicroBatchSignature:
    spec: TreeSpec
    leaves: tuple[Any, ...]  # a TensorLeaf per tensor leaf, the value itself otherwise


BatchSignature = tuple[MicroBatchSignature, ...]


def batch_signature(batches: Sequence[Any]) -> BatchSignature:
    """The signature of a step's micro-batches (one entry per micro-batch)."""
    signatures = []
    for batch in batches:
        leaves, spec = tree_flatten(batch)
        described = tuple(
            TensorLeaf(tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves
        )
        signatures.append(MicroBatchSignature(spec, described))
    return tuple(signatures)


def _same_value(left: Any, right: Any) -> bool:
    if type(left) is not type(right):
        return False
    try:
        return bool(left == right)
    except (TypeError, ValueError, RuntimeError):  # e.g. an array's elementwise `==`
        return False


def signature_mismatch(captured: BatchSignature, current: BatchSignature) -> str | None:
    """None when a step with `current` can replay what was captured with `captured`; else the first difference."""
    if len(captured) != len(current):
        return f"{len(current)} micro-batches, the capture had {len(captured)}"
    for index, (old, new) in enumerate(zip(captured, current, strict=True)):
        if old.spec != new.spec:
            return f"micro-batch {index} has another structure ({new.spec} instead of {old.spec})"
        for position, (was, now) in enumerate(zip(old.leaves, new.leaves, strict=True)):
            if isinstance(was, TensorLeaf) or isinstance(now, TensorLeaf):
                if was != now:
                    return f"micro-batch {index}, leaf {position}: {_describe(now)} instead of {_describe(was)}"
            elif not _same_value(was, now):
                return f"micro-batch {index}, leaf {position}: the value {now!r} instead of {was!r}"
    return None


def _describe(leaf: Any) -> str:
    if isinstance(leaf, TensorLeaf):
        return f"a {list(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')} tensor"
    return f"the value {leaf!r}"


class StaticBatches:
    """Device buffers for every tensor leaf of a step's micro-batches, and the batches rebuilt over them (what the
    captured forwards read). `fill` copies a later step's batches (of the same signature) in."""

    def __init__(self, batches: Sequence[Any], device: torch.device) -> None:
        self.signature = batch_signature(batches)
        self.buffers: list[list[torch.Tensor | None]] = []
        rebuilt = []
        for batch in batches:
            leaves, spec = tree_flatten(batch)
            buffers = [
                torch.empty(leaf.shape, dtype=leaf.dtype, device=device) if isinstance(leaf, torch.Tensor) else None
                for leaf in leaves
            ]
            self.buffers.append(buffers)
            rebuilt.append(
                tree_unflatten(
                    [leaf if buffer is None else buffer for leaf, buffer in zip(leaves, buffers, strict=True)], spec
                )
            )
        self.batches: list[Any] = rebuilt
        self.fill(batches)

    def fill(self, batches: Sequence[Any]) -> None:
        """Copy the tensor leaves of `batches` (whose signature the caller checked) into the buffers."""
        for batch, buffers in zip(batches, self.buffers, strict=True):
            leaves, _ = tree_flatten(batch)
            for leaf, buffer in zip(leaves, buffers, strict=True):
                if buffer is not None:
                    buffer.copy_(leaf, non_blocking=leaf.device.type != "cpu" or leaf.is_pinned())
