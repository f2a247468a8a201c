"""Restricting a mapper to some of its groups (each rank of a distributed conversion takes its share)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from d9d.states.errors import MappingError
from d9d.states.mapper.api import ModelStateMapper, RegionPlan, StateGroup, Tensors
from d9d.states.meta import Box, TensorMeta


class RestrictGroups(ModelStateMapper):
    """Only `groups` of `mapper`; each must be one of its declared groups."""

    def __init__(self, mapper: ModelStateMapper, groups: Iterable[StateGroup]) -> None:
        self._mapper = mapper
        self._groups = frozenset(groups)
        unknown = self._groups - mapper.state_dependency_groups()
        if unknown:
            shown = "; ".join(group.describe() for group in list(unknown)[:3])
            raise MappingError(f"RestrictGroups: {len(unknown)} groups are not groups of {mapper.describe()}: {shown}")
        self._inputs = {group.inputs for group in self._groups}

    def _check(self, names: Iterable[str]) -> None:
        if frozenset(names) not in self._inputs:
            raise MappingError(f"{self.describe()}: no group reads exactly {sorted(names)} in this restriction")

    def state_dependency_groups(self) -> frozenset[StateGroup]:
        return self._groups

    def apply(self, group: Mapping[str, torch.Tensor]) -> Tensors:
        self._check(group)
        return self._mapper.apply(group)

    def infer(self, group: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        self._check(group)
        return self._mapper.infer(group)

    def plan_regions(self, group: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan:
        self._check(group)
        return self._mapper.plan_regions(group, wanted)

    def describe(self) -> str:
        return f"RestrictGroups({self._mapper.describe()}, {len(self._groups)} groups)"
