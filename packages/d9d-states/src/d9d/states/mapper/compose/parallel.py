"""Disjoint union of mappers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from d9d.states.mapper.api import GroupIndex, ModelStateMapper, RegionPlan, StateGroup, Tensors
from d9d.states.mapper.checks import check_disjoint
from d9d.states.meta import Box, TensorMeta


class Parallel(ModelStateMapper):
    """Every group of every child; children must read and write disjoint names."""

    def __init__(self, mappers: Sequence[ModelStateMapper]) -> None:
        self._mappers = tuple(mappers)
        labelled = [
            (f"child {position} ({mapper.describe()})", group)
            for position, mapper in enumerate(self._mappers)
            for group in mapper.state_dependency_groups()
        ]
        check_disjoint(labelled, owner="Parallel")
        self._index: GroupIndex[ModelStateMapper] = GroupIndex("Parallel")
        for mapper in self._mappers:
            for group in mapper.state_dependency_groups():
                self._index.add(group.inputs, mapper)
        self._groups = frozenset(group for _, group in labelled)

    def state_dependency_groups(self) -> frozenset[StateGroup]:
        return self._groups

    def apply(self, group: Mapping[str, torch.Tensor]) -> Tensors:
        return self._index.find(group).apply(group)

    def infer(self, group: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        return self._index.find(group).infer(group)

    def plan_regions(self, group: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan:
        return self._index.find(group).plan_regions(group, wanted)

    def describe(self) -> str:
        return f"Parallel of {len(self._mappers)}"
