"""Running a mapper under one or more name prefixes (e.g. the same layer mapper for every layer)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch

from d9d.states.errors import MappingError
from d9d.states.mapper.api import GroupIndex, ModelStateMapper, RegionPlan, StateGroup, Tensors
from d9d.states.mapper.checks import check_disjoint, check_names
from d9d.states.meta import Box, TensorMeta

_V = TypeVar("_V")


def _strip(values: Mapping[str, _V], prefix: str) -> dict[str, _V]:
    return {name.removeprefix(prefix): value for name, value in values.items()}


def _take(values: Tensors, prefix: str) -> Tensors:
    """Like `_strip`, emptying `values`: a region plan's `run` takes its inputs over."""
    return {name.removeprefix(prefix): values.pop(name) for name in list(values)}


def _add(values: Mapping[str, _V], prefix: str) -> dict[str, _V]:
    return {prefix + name: value for name, value in values.items()}


class PrefixScope(ModelStateMapper):
    """`mapper` with every input and output name prefixed, once per prefix (`model.layers.0.`, ...)."""

    def __init__(self, mapper: ModelStateMapper, prefixes: str | Sequence[str]) -> None:
        self._mapper = mapper
        self._prefixes = check_names([prefixes] if isinstance(prefixes, str) else prefixes, what="PrefixScope")
        if not self._prefixes:
            raise MappingError("PrefixScope: needs at least one prefix")
        self._index: GroupIndex[str] = GroupIndex(self.describe())
        labelled: list[tuple[str, StateGroup]] = []
        for prefix in self._prefixes:
            for group in mapper.state_dependency_groups():
                scoped = StateGroup(
                    inputs=frozenset(prefix + name for name in group.inputs),
                    outputs=frozenset(prefix + name for name in group.outputs),
                )
                labelled.append((f"prefix {prefix!r}", scoped))
                self._index.add(scoped.inputs, prefix)
        check_disjoint(labelled, owner=self.describe())
        self._groups = frozenset(group for _, group in labelled)

    def state_dependency_groups(self) -> frozenset[StateGroup]:
        return self._groups

    def apply(self, group: Mapping[str, torch.Tensor]) -> Tensors:
        prefix = self._index.find(group)
        return _add(self._mapper.apply(_strip(group, prefix)), prefix)

    def infer(self, group: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        prefix = self._index.find(group)
        return _add(self._mapper.infer(_strip(group, prefix)), prefix)

    def plan_regions(self, group: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan:
        prefix = self._index.find(group)
        inner = self._mapper.plan_regions(_strip(group, prefix), _strip(wanted, prefix))
        copies = None
        if inner.copies is not None:
            copies = tuple(c.renamed(source=prefix + c.source, target=prefix + c.target) for c in inner.copies)
        return RegionPlan(
            reads=_add(inner.reads, prefix),
            run=lambda tensors: _add(inner.run(_take(tensors, prefix)), prefix),
            copies=copies,
        )

    def describe(self) -> str:
        shown = ", ".join(repr(p) for p in self._prefixes[:2]) + (", ..." if len(self._prefixes) > 2 else "")
        return f"PrefixScope({self._mapper.describe()}, {shown})"
