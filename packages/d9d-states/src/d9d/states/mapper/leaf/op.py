"""One dependency group's transform (`Op`) and the mapper made of a collection of them (`OpMapper`)."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence

import torch

from d9d.states.mapper.api import GroupIndex, ModelStateMapper, RegionPlan, StateGroup, Tensors, full_read_plan
from d9d.states.mapper.checks import check_disjoint
from d9d.states.mapper.copies import Copy
from d9d.states.meta import Box, TensorMeta, box_numel, box_shape


class Op(abc.ABC):
    """The transform of one group: fixed input and output names."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def group(self) -> StateGroup:
        return StateGroup(inputs=frozenset(self.inputs), outputs=frozenset(self.outputs))

    @abc.abstractmethod
    def apply(self, tensors: Mapping[str, torch.Tensor]) -> Tensors: ...

    @abc.abstractmethod
    def infer(self, metas: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]: ...

    def plan_regions(self, metas: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan | None:
        """Regions of the inputs that produce `wanted`; `None` to read whole inputs (the default)."""
        del metas, wanted
        return None


class UnaryOp(Op):
    """An op from one tensor to one tensor whose output region comes from one input region."""

    def __init__(self, source: str, target: str) -> None:
        self.inputs = (source,)
        self.outputs = (target,)

    @property
    def source(self) -> str:
        return self.inputs[0]

    @property
    def target(self) -> str:
        return self.outputs[0]

    @abc.abstractmethod
    def transform(self, tensor: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def infer_one(self, meta: TensorMeta) -> TensorMeta: ...

    @abc.abstractmethod
    def input_box(self, output_box: Box, meta: TensorMeta) -> Box:
        """The region of the input (of metadata `meta`) that `transform` turns into `output_box`."""

    def moves_only(self, meta: TensorMeta) -> bool:
        """Whether `transform` only moves elements, in order (a rename, a squeeze), for an input of `meta`."""
        del meta
        return False

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> Tensors:
        return {self.target: self.transform(tensors[self.source])}

    def infer(self, metas: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        return {self.target: self.infer_one(metas[self.source])}

    def plan_regions(self, metas: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan | None:
        if self.target not in wanted:
            return RegionPlan(reads={}, run=lambda _: {}, copies=())
        box = wanted[self.target]
        meta = metas[self.source]
        if box_numel(box) == 0:
            # Nothing to read (e.g. a rank whose shard of an uneven split is empty); the shape alone is the answer.
            dtype = self.infer_one(meta).dtype
            run = lambda _: {self.target: torch.empty(box_shape(box), dtype=dtype)}  # noqa: E731
            return RegionPlan(reads={}, run=run, copies=())
        read = self.input_box(box, meta)
        copies = (Copy(self.source, read, self.target, box),) if self.moves_only(meta) else None
        return RegionPlan(
            reads={self.source: read},
            run=lambda tensors: {self.target: self.transform(tensors[self.source])},
            copies=copies,
        )


class OpMapper(ModelStateMapper):
    """A mapper made of independent ops, one group each (e.g. one rename per tensor)."""

    def __init__(self, ops: Sequence[Op]) -> None:
        self._ops = tuple(ops)
        check_disjoint(((self.describe(), op.group) for op in self._ops), owner=self.describe())
        self._index: GroupIndex[Op] = GroupIndex(self.describe())
        for op in self._ops:
            self._index.add(op.group.inputs, op)
        self._groups = frozenset(op.group for op in self._ops)

    def state_dependency_groups(self) -> frozenset[StateGroup]:
        return self._groups

    def apply(self, group: Mapping[str, torch.Tensor]) -> Tensors:
        return self._index.find(group).apply(group)

    def infer(self, group: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        return self._index.find(group).infer(group)

    def plan_regions(self, group: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan:
        op = self._index.find(group)
        op.infer(group)  # shape checks first: a region plan assumes shapes that fit
        return op.plan_regions(group, wanted) or full_read_plan(self, group, wanted)


def as_names(names: str | Iterable[str]) -> tuple[str, ...]:
    """One name or several, as a tuple (a bare string is one name, not its characters)."""
    return (names,) if isinstance(names, str) else tuple(names)
