"""Mappers that change a tensor's shape, not its values: squeeze, unsqueeze, transpose."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import torch

from d9d.states.errors import MappingError
from d9d.states.mapper.checks import check_names
from d9d.states.mapper.leaf.op import OpMapper, UnaryOp, as_names
from d9d.states.meta import Box, TensorMeta, normalize_dim


class SqueezeOp(UnaryOp):
    def __init__(self, name: str, dim: int) -> None:
        super().__init__(name, name)
        self.dim = dim

    def _dim(self, meta: TensorMeta) -> int:
        dim = normalize_dim(self.dim, len(meta.shape), what=f"Squeeze of {self.source!r}")
        if meta.shape[dim] != 1:
            raise MappingError(
                f"Squeeze: {self.source!r} has shape {list(meta.shape)}; dimension {self.dim} has size "
                f"{meta.shape[dim]}, not 1"
            )
        return dim

    def transform(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.squeeze(self.dim)

    def infer_one(self, meta: TensorMeta) -> TensorMeta:
        dim = self._dim(meta)
        return TensorMeta(shape=meta.shape[:dim] + meta.shape[dim + 1 :], dtype=meta.dtype)

    def input_box(self, output_box: Box, meta: TensorMeta) -> Box:
        dim = self._dim(meta)
        return (*output_box[:dim], (0, 1), *output_box[dim:])

    def moves_only(self, meta: TensorMeta) -> bool:
        return True


class UnsqueezeOp(UnaryOp):
    def __init__(self, name: str, dim: int) -> None:
        super().__init__(name, name)
        self.dim = dim

    def _dim(self, meta: TensorMeta) -> int:
        return normalize_dim(self.dim, len(meta.shape) + 1, what=f"Unsqueeze of {self.source!r}")

    def transform(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.unsqueeze(self.dim)

    def infer_one(self, meta: TensorMeta) -> TensorMeta:
        dim = self._dim(meta)
        return TensorMeta(shape=(*meta.shape[:dim], 1, *meta.shape[dim:]), dtype=meta.dtype)

    def input_box(self, output_box: Box, meta: TensorMeta) -> Box:
        dim = self._dim(meta)
        return output_box[:dim] + output_box[dim + 1 :]

    def moves_only(self, meta: TensorMeta) -> bool:
        return True


class TransposeOp(UnaryOp):
    def __init__(self, name: str, dim0: int, dim1: int) -> None:
        super().__init__(name, name)
        self.dims = (dim0, dim1)

    def _dims(self, meta: TensorMeta) -> tuple[int, int]:
        what = f"Transpose of {self.source!r}"
        return normalize_dim(self.dims[0], len(meta.shape), what=what), normalize_dim(
            self.dims[1], len(meta.shape), what=what
        )

    def transform(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.transpose(*self.dims)

    def infer_one(self, meta: TensorMeta) -> TensorMeta:
        return TensorMeta(shape=_swap(meta.shape, *self._dims(meta)), dtype=meta.dtype)

    def input_box(self, output_box: Box, meta: TensorMeta) -> Box:
        return _swap(output_box, *self._dims(meta))


_T = TypeVar("_T")


def _swap(items: tuple[_T, ...], first: int, second: int) -> tuple[_T, ...]:
    swapped = list(items)
    swapped[first], swapped[second] = swapped[second], swapped[first]
    return tuple(swapped)


class Squeeze(OpMapper):
    """Remove dimension `dim` (of size 1) from each named tensor."""

    def __init__(self, names: str | Iterable[str], dim: int) -> None:
        super().__init__([SqueezeOp(name, dim) for name in check_names(as_names(names), what="Squeeze")])


class Unsqueeze(OpMapper):
    """Insert a dimension of size 1 at `dim` into each named tensor."""

    def __init__(self, names: str | Iterable[str], dim: int) -> None:
        super().__init__([UnsqueezeOp(name, dim) for name in check_names(as_names(names), what="Unsqueeze")])


class Transpose(OpMapper):
    """Swap dimensions `dim0` and `dim1` of each named tensor (stored contiguously when written)."""

    def __init__(self, names: str | Iterable[str], dim0: int = 0, dim1: int = 1) -> None:
        super().__init__([TransposeOp(name, dim0, dim1) for name in check_names(as_names(names), what="Transpose")])
