"""Tensor metadata and boxes: what the planner knows about a tensor before reading it.

A `Box` is a half-open range `(start, stop)` per dimension of a tensor's global shape. It describes the part of a
tensor a rank needs (its DTensor shard) and, propagated backwards through a mapping, the part of each stored tensor
that must be read to produce it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor, known without its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def describe(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        """Metadata of a tensor; for a DTensor, of its global (logical) tensor."""
        return cls(shape=tuple(tensor.shape), dtype=tensor.dtype)


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, size) for size in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_numel(box: Box) -> int:
    return math.prod(box_shape(box))


def is_full(box: Box, shape: Sequence[int]) -> bool:
    return box == full_box(shape)


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def crop(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    """The part of a full tensor inside `box`, as a view."""
    return tensor[box_slices(box)]


def bounding_box(boxes: Sequence[Box]) -> Box:
    """The smallest box containing every non-empty box (all of one rank); empty when all are empty."""
    non_empty = [box for box in boxes if box_numel(box) > 0]
    if not non_empty:
        return boxes[0]
    return tuple(
        (min(box[dim][0] for box in non_empty), max(box[dim][1] for box in non_empty))
        for dim in range(len(non_empty[0]))
    )


def shift(box: Box, origin: Box) -> Box:
    """`box` in the coordinates of a region that starts at `origin` (a box containing it)."""
    return tuple((start - base, stop - base) for (start, stop), (base, _) in zip(box, origin, strict=True))


def normalize_dim(dim: int, ndim: int, *, what: str) -> int:
    """A dimension index in `[0, ndim)`; negative indices count from the end, as in PyTorch."""
    if not -ndim <= dim < ndim:
        raise IndexError(f"{what}: dimension {dim} is out of range for a tensor of {ndim} dimensions")
    return dim % ndim


def is_dtensor(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether `tensor` is a DTensor, without importing DTensor (2 s of start-up) when nothing has yet."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)
