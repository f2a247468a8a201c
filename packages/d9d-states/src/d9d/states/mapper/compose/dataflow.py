"""The engine behind `Sequential` and `Graph`: groups of child mappers wired by name into one dataflow.

Every child group becomes a node; a name written by one node and read by another is an intermediate that never
leaves the mapper. Names are `(level, name)` pairs so that `Sequential` can keep the names between its stages apart
(`Graph` uses one level). Each name has at most one writer and one reader; the wiring must be acyclic. Connected
nodes form one net group: the names they read from outside are its inputs, the names nobody reads are its outputs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from d9d.states.errors import MappingError, describe_names
from d9d.states.mapper.api import GroupIndex, ModelStateMapper, RegionPlan, StateGroup, Tensors
from d9d.states.mapper.copies import Copy, compose
from d9d.states.meta import Box, TensorMeta

FlowName = tuple[int, str]


@dataclass(frozen=True)
class Node:
    """One group of a child mapper, with its names translated to flow names."""

    mapper: ModelStateMapper
    group: StateGroup
    inputs: Mapping[str, FlowName]
    outputs: Mapping[str, FlowName]
    label: str


@dataclass(frozen=True)
class _NetGroup:
    group: StateGroup
    nodes: tuple[Node, ...]  # in execution order
    sources: Mapping[str, FlowName]
    sinks: Mapping[FlowName, str]


class Dataflow:
    def __init__(self, nodes: Sequence[Node], *, owner: str, show: Callable[[FlowName], str]) -> None:
        self._owner = owner
        self._show = show
        writer = self._unique(nodes, lambda node: node.outputs.values(), "written")
        reader = self._unique(nodes, lambda node: node.inputs.values(), "read")
        order = self._topological_order(nodes, writer)
        self._net_groups = self._net(order, writer, reader)
        self._index: GroupIndex[_NetGroup] = GroupIndex(owner)
        for net in self._net_groups:
            self._index.add(net.group.inputs, net)

    @property
    def groups(self) -> frozenset[StateGroup]:
        return frozenset(net.group for net in self._net_groups)

    # Construction ------------------------------------------------------------------------------------------------

    def _unique(
        self, nodes: Sequence[Node], names_of: Callable[[Node], Iterable[FlowName]], verb: str
    ) -> dict[FlowName, Node]:
        seen: dict[FlowName, Node] = {}
        for node in nodes:
            for name in names_of(node):
                if name in seen:
                    raise MappingError(
                        f"{self._owner}: {self._show(name)} is {verb} by two groups, {seen[name].group.describe()} "
                        f"of {seen[name].label} and {node.group.describe()} of {node.label}; every name may be "
                        f"{verb} by one group only"
                    )
                seen[name] = node
        return seen

    def _topological_order(self, nodes: Sequence[Node], writer: Mapping[FlowName, Node]) -> list[Node]:
        """Nodes so that each comes after the writers of its inputs; a cycle is an error naming its names."""
        done: set[int] = set()
        active: list[tuple[Node, FlowName | None]] = []
        order: list[Node] = []

        def visit(node: Node, via: FlowName | None) -> None:
            if id(node) in done:
                return
            if any(entry is node for entry, _ in active):
                start = next(i for i, (entry, _) in enumerate(active) if entry is node)
                names = [name for _, name in active[start + 1 :]] + [via]
                path = " -> ".join(self._show(name) for name in names if name is not None)
                raise MappingError(f"{self._owner}: the mapping has a cycle through {path} -> (back to the start)")
            active.append((node, via))
            for name in node.inputs.values():
                if name in writer:
                    visit(writer[name], name)
            active.pop()
            done.add(id(node))
            order.append(node)

        for node in nodes:
            visit(node, None)
        return order

    def _net(
        self, order: list[Node], writer: Mapping[FlowName, Node], reader: Mapping[FlowName, Node]
    ) -> list[_NetGroup]:
        # Union-find over nodes joined by an intermediate name.
        parent = {id(node): id(node) for node in order}

        def root(key: int) -> int:
            while parent[key] != key:
                parent[key] = parent[parent[key]]
                key = parent[key]
            return key

        for name, node in writer.items():
            if name in reader:
                parent[root(id(node))] = root(id(reader[name]))
        members: dict[int, list[Node]] = defaultdict(list)
        for node in order:
            members[root(id(node))].append(node)
        nets = []
        for nodes in members.values():
            sources = {name[1]: name for node in nodes for name in node.inputs.values() if name not in writer}
            sinks = {name: name[1] for node in nodes for name in node.outputs.values() if name not in reader}
            if len(set(sinks.values())) != len(sinks):
                raise MappingError(f"{self._owner}: outputs {describe_names(sinks.values())} collide")
            group = StateGroup(inputs=frozenset(sources), outputs=frozenset(sinks.values()))
            nets.append(_NetGroup(group=group, nodes=tuple(nodes), sources=sources, sinks=sinks))
        return nets

    # Execution --------------------------------------------------------------------------------------------------

    def apply(self, group: Mapping[str, torch.Tensor]) -> Tensors:
        net = self._index.find(group)
        env = {net.sources[name]: tensor for name, tensor in group.items()}
        for node in net.nodes:
            # Each name has one reader: popping it frees intermediates as soon as they are used.
            arguments = {name: env.pop(flow) for name, flow in node.inputs.items()}
            produced = node.mapper.apply(arguments)
            self._check_produced(node, produced.keys(), node.group.outputs)
            env.update({node.outputs[name]: tensor for name, tensor in produced.items()})
        return {net.sinks[flow]: tensor for flow, tensor in env.items()}

    def infer(self, group: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        net = self._index.find(group)
        metas = self._infer_all(net, group)
        return {name: metas[flow] for flow, name in net.sinks.items()}

    def _infer_all(self, net: _NetGroup, group: Mapping[str, TensorMeta]) -> dict[FlowName, TensorMeta]:
        metas = {net.sources[name]: meta for name, meta in group.items()}
        for node in net.nodes:
            produced = node.mapper.infer({name: metas[flow] for name, flow in node.inputs.items()})
            self._check_produced(node, produced.keys(), node.group.outputs)
            metas.update({node.outputs[name]: meta for name, meta in produced.items()})
        return metas

    def plan_regions(self, group: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan:
        net = self._index.find(group)
        metas = self._infer_all(net, group)
        flow_of_sink = {name: flow for flow, name in net.sinks.items()}
        needed: dict[FlowName, Box] = {flow_of_sink[name]: box for name, box in wanted.items()}
        steps: list[tuple[Node, RegionPlan]] = []
        # Backwards: what each node must produce decides what it reads, which is what its writers must produce.
        for node in reversed(net.nodes):
            node_wanted = {name: needed[flow] for name, flow in node.outputs.items() if flow in needed}
            if not node_wanted:
                continue  # nothing downstream needs it (another rank's expert, a dropped tensor)
            plan = node.mapper.plan_regions({name: metas[flow] for name, flow in node.inputs.items()}, node_wanted)
            needed.update({node.inputs[name]: box for name, box in plan.reads.items()})
            steps.append((node, plan))
        steps.reverse()
        reads = {name: needed[flow] for name, flow in net.sources.items() if flow in needed}

        def run(tensors: Tensors) -> Tensors:
            # Take the tensors over (the caller's dict empties) so each input is freed once its reader has run.
            env = {net.sources[name]: tensors.pop(name) for name in list(tensors)}
            for node, plan in steps:
                produced = plan.run({name: env.pop(node.inputs[name]) for name in plan.reads})
                env.update({node.outputs[name]: tensor for name, tensor in produced.items()})
            return {name: env[flow_of_sink[name]] for name in wanted}

        return RegionPlan(reads=reads, run=run, copies=self._compose_copies(net, steps, wanted, flow_of_sink))

    @staticmethod
    def _compose_copies(
        net: _NetGroup,
        steps: list[tuple[Node, RegionPlan]],
        wanted: Mapping[str, Box],
        flow_of_sink: Mapping[str, FlowName],
    ) -> tuple[Copy, ...] | None:
        """Chain the steps' copies into copies from the group's inputs to its outputs, if every step only copies."""
        if any(plan.copies is None for _, plan in steps):
            return None
        input_of = {flow: name for name, flow in net.sources.items()}
        into: dict[FlowName, list[Copy]] = {}  # copies from group inputs into each flow name produced so far
        for node, plan in steps:
            for copy in plan.copies or ():
                source, target = node.inputs[copy.source], node.outputs[copy.target]
                if source in input_of:
                    found = [Copy(input_of[source], copy.source_box, "", copy.target_box)]
                else:
                    found = [c for earlier in into.get(source, []) if (c := compose(earlier, copy)) is not None]
                into.setdefault(target, []).extend(found)
        return tuple(c.renamed(target=name) for name in wanted for c in into.get(flow_of_sink[name], []))

    def _check_produced(self, node: Node, produced: Iterable[str], declared: frozenset[str]) -> None:
        names = frozenset(produced)
        if names != declared:
            raise MappingError(
                f"{self._owner}: {node.label} returned {{{describe_names(names)}}} for group {node.group.describe()}; "
                "a mapper must return exactly the outputs it declares"
            )
