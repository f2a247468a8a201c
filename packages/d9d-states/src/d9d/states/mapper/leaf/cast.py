"""Dtype conversion."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from d9d.states.mapper.checks import check_names
from d9d.states.mapper.leaf.op import OpMapper, UnaryOp, as_names
from d9d.states.meta import Box, TensorMeta


class CastOp(UnaryOp):
    def __init__(self, name: str, dtype: torch.dtype) -> None:
        super().__init__(name, name)
        self.dtype = dtype

    def transform(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype)

    def infer_one(self, meta: TensorMeta) -> TensorMeta:
        return TensorMeta(shape=meta.shape, dtype=self.dtype)

    def input_box(self, output_box: Box, meta: TensorMeta) -> Box:
        return output_box

    def moves_only(self, meta: TensorMeta) -> bool:
        return meta.dtype == self.dtype


class CastDtype(OpMapper):
    """Convert each named tensor to `dtype` (a no-op for tensors already of that dtype)."""

    def __init__(self, names: str | Iterable[str], dtype: torch.dtype) -> None:
        super().__init__([CastOp(name, dtype) for name in check_names(as_names(names), what="CastDtype")])
