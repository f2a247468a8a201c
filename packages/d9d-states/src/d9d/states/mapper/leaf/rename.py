"""Mappers that move tensors without touching their data: identity, rename, select a sub-module, drop."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from d9d.states.errors import MappingError
from d9d.states.mapper.api import RegionPlan, Tensors
from d9d.states.mapper.checks import check_names
from d9d.states.mapper.leaf.op import Op, OpMapper, UnaryOp, as_names
from d9d.states.meta import Box, TensorMeta


class RenameOp(UnaryOp):
    def transform(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def infer_one(self, meta: TensorMeta) -> TensorMeta:
        return meta

    def input_box(self, output_box: Box, meta: TensorMeta) -> Box:
        return output_box

    def moves_only(self, meta: TensorMeta) -> bool:
        return True


class Rename(OpMapper):
    """`{old: new}`: each tensor keeps its data under a new name (one group per tensor)."""

    def __init__(self, names: Mapping[str, str]) -> None:
        check_names(names.values(), what="Rename targets")
        super().__init__([RenameOp(source, target) for source, target in names.items()])


class Identity(Rename):
    """Tensors pass unchanged under their own names."""

    def __init__(self, names: str | Iterable[str]) -> None:
        super().__init__({name: name for name in check_names(as_names(names), what="Identity")})


class SelectChildModules(Rename):
    """Take the tensors of one sub-module: `{parent}.{name}` becomes `{name}` for each of `names`.

    `names` are relative to the child (e.g. `layers.0.mlp.weight` with `parent="model"`). The reverse direction
    (adding a parent) is `PrefixScope(Identity(names), parent + ".")`.
    """

    def __init__(self, parent: str, names: str | Iterable[str]) -> None:
        if not parent or parent.endswith("."):
            raise MappingError(f"SelectChildModules: parent {parent!r} must be a module path without a trailing dot")
        super().__init__({f"{parent}.{name}": name for name in as_names(names)})


class DropOp(Op):
    def __init__(self, name: str) -> None:
        self.inputs = (name,)
        self.outputs = ()

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> Tensors:
        return {}

    def infer(self, metas: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        return {}

    def plan_regions(self, metas: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan:
        return RegionPlan(reads={}, run=lambda _: {}, copies=())


class Drop(OpMapper):
    """Consume tensors and produce nothing (e.g. a stored `rotary_emb.inv_freq` a model recomputes).

    Dropping is explicit so that an unmapped source tensor stays an error rather than a silent loss.
    """

    def __init__(self, names: str | Iterable[str]) -> None:
        super().__init__([DropOp(name) for name in check_names(as_names(names), what="Drop")])
