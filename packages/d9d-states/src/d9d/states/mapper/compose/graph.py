"""Mappers wired by name in one namespace, in any order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from d9d.states.mapper.api import ModelStateMapper, RegionPlan, StateGroup, Tensors
from d9d.states.mapper.compose.dataflow import Dataflow, FlowName, Node
from d9d.states.meta import Box, TensorMeta


def _show(name: FlowName) -> str:
    return repr(name[1])


class Graph(ModelStateMapper):
    """Children whose outputs feed each other's inputs by name; order does not matter.

    A name written by one child and read by another is an intermediate. The remaining inputs are read from the
    source and the remaining outputs are the results. A name written twice, read twice, or a cycle is a
    `MappingError` naming the names.
    """

    def __init__(self, mappers: Sequence[ModelStateMapper]) -> None:
        nodes = [
            Node(
                mapper=mapper,
                group=group,
                inputs={name: (0, name) for name in group.inputs},
                outputs={name: (0, name) for name in group.outputs},
                label=f"child {position} ({mapper.describe()})",
            )
            for position, mapper in enumerate(mappers)
            for group in mapper.state_dependency_groups()
        ]
        self._flow = Dataflow(nodes, owner="Graph", show=_show)
        self._groups = self._flow.groups

    def state_dependency_groups(self) -> frozenset[StateGroup]:
        return self._groups

    def apply(self, group: Mapping[str, torch.Tensor]) -> Tensors:
        return self._flow.apply(group)

    def infer(self, group: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        return self._flow.infer(group)

    def plan_regions(self, group: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan:
        return self._flow.plan_regions(group, wanted)
