"""Stages applied one after another; names a stage does not touch pass through it unchanged."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from d9d.states.errors import MappingError
from d9d.states.mapper.api import ModelStateMapper, RegionPlan, StateGroup, Tensors
from d9d.states.mapper.compose.dataflow import Dataflow, FlowName, Node
from d9d.states.mapper.leaf.rename import Identity
from d9d.states.meta import Box, TensorMeta


def _names(groups: frozenset[StateGroup], side: str) -> set[str]:
    return {name for group in groups for name in getattr(group, side)}


class Sequential(ModelStateMapper):
    """Run `stages` in order, each on what the previous one produced.

    A name a later stage reads that an earlier stage does not produce passes through the stages in between
    unchanged, as does an output no later stage reads. The result exposes net groups: inputs of the first stage to
    outputs of the last. A pass-through that collides with what a stage reads or writes is a `MappingError` naming
    the name and the stage.
    """

    def __init__(self, stages: Sequence[ModelStateMapper]) -> None:
        stages = [stage for stage in stages if stage.state_dependency_groups()]
        if not stages:
            raise MappingError("Sequential: needs at least one stage with groups")
        self._count = len(stages)
        groups = [stage.state_dependency_groups() for stage in stages]
        inputs = [_names(g, "inputs") for g in groups]
        outputs = [_names(g, "outputs") for g in groups]
        passes: list[set[str]] = [set() for _ in stages]
        # Backwards: what stage k+1 reads and stage k does not write must pass through stage k.
        for k in range(len(stages) - 2, -1, -1):
            passes[k] |= (inputs[k + 1] | passes[k + 1]) - outputs[k]
        # Forwards: what stage k writes (or passes) and stage k+1 does not read passes through stage k+1.
        for k in range(len(stages) - 1):
            passes[k + 1] |= (outputs[k] | passes[k]) - inputs[k + 1]
        nodes: list[Node] = []
        for k, stage in enumerate(stages):
            label = f"stage {k} ({stage.describe()})"
            nodes += [self._node(stage, group, k, label) for group in groups[k]]
            if passes[k]:
                through = Identity(sorted(passes[k]))
                nodes += [
                    self._node(through, group, k, f"stage {k} (pass-through)")
                    for group in through.state_dependency_groups()
                ]
        self._flow = Dataflow(nodes, owner="Sequential", show=self._show)
        self._groups = self._flow.groups

    def _node(self, mapper: ModelStateMapper, group: StateGroup, stage: int, label: str) -> Node:
        return Node(
            mapper=mapper,
            group=group,
            inputs={name: (stage, name) for name in group.inputs},
            outputs={name: (stage + 1, name) for name in group.outputs},
            label=label,
        )

    def _show(self, name: FlowName) -> str:
        level, text = name
        if level == 0:
            return f"{text!r} (an input)"
        if level == self._count:
            return f"{text!r} (an output)"
        return f"{text!r} (between stages {level - 1} and {level})"

    def state_dependency_groups(self) -> frozenset[StateGroup]:
        return self._groups

    def apply(self, group: Mapping[str, torch.Tensor]) -> Tensors:
        return self._flow.apply(group)

    def infer(self, group: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        return self._flow.infer(group)

    def plan_regions(self, group: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan:
        return self._flow.plan_regions(group, wanted)

    def describe(self) -> str:
        return f"Sequential of {self._count}"
