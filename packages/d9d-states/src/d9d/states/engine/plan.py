"""A checked, ordered plan: which groups run, in what order, on what metadata. Built before any data is read."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from d9d.states.errors import MappingError, StateMismatchError, describe_names
from d9d.states.mapper.api import ModelStateMapper, StateGroup
from d9d.states.meta import TensorMeta


@dataclass(frozen=True)
class PlannedGroup:
    group: StateGroup
    inputs: dict[str, TensorMeta]
    outputs: dict[str, TensorMeta]  # sorted by name: the order they are produced and written

    @property
    def nbytes(self) -> int:
        """Bytes of its inputs and outputs: about what running it holds in memory."""
        return sum(m.nbytes for m in self.inputs.values()) + sum(m.nbytes for m in self.outputs.values())


@dataclass(frozen=True)
class StatePlan:
    groups: tuple[PlannedGroup, ...]

    def outputs(self) -> dict[str, TensorMeta]:
        return {name: meta for planned in self.groups for name, meta in planned.outputs.items()}

    @property
    def largest_group_bytes(self) -> int:
        return max((planned.nbytes for planned in self.groups), default=0)

    @property
    def input_bytes(self) -> int:
        return sum(m.nbytes for planned in self.groups for m in planned.inputs.values())

    @property
    def output_bytes(self) -> int:
        return sum(m.nbytes for planned in self.groups for m in planned.outputs.values())

    def subset(self, groups: frozenset[StateGroup]) -> StatePlan:
        return StatePlan(tuple(planned for planned in self.groups if planned.group in groups))


def plan_states(
    mapper: ModelStateMapper,
    available: Mapping[str, TensorMeta],
    *,
    source: str,
    where: Callable[[str], str] | None = None,
    position: Callable[[str], tuple[int, int]] | None = None,
    allow_unused: bool = False,
) -> StatePlan:
    """Check `mapper` against the tensors `available` in `source` and order its groups for reading.

    Raises `StateMismatchError` for inputs the source lacks or (unless `allow_unused`) source tensors the mapping
    never reads, and `MappingError` for shapes that do not fit. `where(name)` names a tensor's file for messages;
    groups run in the order of `position` of their first input, so files are read front to back.
    """
    groups = mapper.state_dependency_groups()
    wanted = {name for group in groups for name in group.inputs}
    missing = wanted - available.keys()
    if missing:
        example = sorted(missing)[0]
        close = difflib.get_close_matches(example, list(available), n=1)
        hint = f"; did you mean {close[0]!r} for {example!r}?" if close else ""
        raise StateMismatchError(
            f"missing tensors: the mapping reads {describe_names(missing)}, which {source} does not have{hint}"
        )
    unused = available.keys() - wanted
    if unused and not allow_unused:
        raise StateMismatchError(
            f"unexpected tensors: {source} has {describe_names(unused)}, which the mapping does not read; map them "
            "(Identity, Drop, ...) or allow unused tensors"
        )
    planned = [_plan_group(mapper, group, available, where) for group in groups]
    order = position or (lambda name: (0, 0))
    planned.sort(key=lambda p: min((order(name), name) for name in p.group.inputs))
    return StatePlan(tuple(planned))


def _plan_group(
    mapper: ModelStateMapper,
    group: StateGroup,
    available: Mapping[str, TensorMeta],
    where: Callable[[str], str] | None,
) -> PlannedGroup:
    inputs = {name: available[name] for name in sorted(group.inputs)}
    try:
        outputs = mapper.infer(inputs)
    except MappingError as error:
        origin = "; ".join(
            f"{name!r} {meta.describe()}" + (f" in {where(name)}" if where else "")
            for name, meta in list(inputs.items())[:4]
        )
        raise MappingError(f"{error} (inputs: {origin})") from error
    if outputs.keys() != group.outputs:
        raise MappingError(
            f"{mapper.describe()}: group {group.describe()} inferred outputs {describe_names(outputs)}; a mapper must "
            "infer exactly the outputs it declares"
        )
    return PlannedGroup(group=group, inputs=inputs, outputs=dict(sorted(outputs.items())))
