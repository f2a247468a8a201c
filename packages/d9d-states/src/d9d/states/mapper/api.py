"""The mapper interface: declared dependency groups first, tensors second.

A mapper declares which input names produce which output names (`state_dependency_groups`) before any tensor
exists, so a whole conversion can be validated, scheduled and split across ranks up front. It then runs one group at
a time: `apply` on whole tensors, `infer` on metadata (shape inference, used to check a plan), and `plan_regions`
to produce only parts of its outputs from parts of its inputs (a rank reading just its DTensor shard).

Input and output names live in separate namespaces: a group `{x} -> {x}` reads `x` from the source and writes `x`
to the destination; it is not a cycle.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from d9d.states.errors import MappingError, describe_names
from d9d.states.mapper.copies import Copy
from d9d.states.meta import Box, TensorMeta, crop, full_box, is_full


@dataclass(frozen=True)
class StateGroup:
    """An atomic unit of work: every name in `inputs` is needed to produce every name in `outputs`."""

    inputs: frozenset[str]
    outputs: frozenset[str]

    def describe(self) -> str:
        return f"{{{describe_names(self.inputs, 4)}}} -> {{{describe_names(self.outputs, 4)}}}"


Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class RegionPlan:
    """How to produce the wanted regions of a group's outputs.

    `reads` maps each input that is needed to the region of it to read (inputs absent from it are not read at all);
    `run` takes those regions, each as a tensor shaped like its box, and returns the wanted outputs, each shaped like
    its wanted box (or a DTensor, for mappers that distribute). `run` takes the dict it is given over and may empty
    it, so that compositions can free each input as soon as it has been used.
    """

    reads: Mapping[str, Box]
    run: Callable[[Tensors], Tensors]
    # Set when the wanted outputs are nothing but input regions moved into place (see `d9d.states.mapper.copies`):
    # a reader may then assemble them directly instead of calling `run`.
    copies: tuple[Copy, ...] | None = None


class ModelStateMapper(abc.ABC):
    """Base of every mapper. Subclasses are immutable; the groups they declare never change."""

    @abc.abstractmethod
    def state_dependency_groups(self) -> frozenset[StateGroup]:
        """Independent groups, each with disjoint inputs and outputs from the others."""

    @abc.abstractmethod
    def apply(self, group: Mapping[str, torch.Tensor]) -> Tensors:
        """Run the group whose inputs are exactly `group`'s keys; return exactly its outputs."""

    @abc.abstractmethod
    def infer(self, group: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        """Output metadata of the group whose inputs are `group`'s keys; `MappingError` if shapes do not fit."""

    def plan_regions(self, group: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan:
        """Plan to produce `wanted` (a region for some of the group's outputs) from regions of its inputs.

        The default reads every input whole, applies the mapper and crops the outputs: always correct, never
        economical. Mappers whose outputs are slices of their inputs' slices override it.
        """
        return full_read_plan(self, group, wanted)

    # Helpers for subclasses ------------------------------------------------------------------------------------

    def describe(self) -> str:
        return type(self).__name__


def full_read_plan(mapper: ModelStateMapper, group: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan:
    """Read whole inputs, apply, crop each wanted output (copied, so the whole input can be freed)."""
    outputs = mapper.infer(group)

    def run(tensors: Tensors) -> Tensors:
        produced = mapper.apply(tensors)
        result: Tensors = {}
        for name, box in wanted.items():
            tensor = produced[name]
            result[name] = tensor if is_full(box, outputs[name].shape) else crop(tensor, box).clone()
        return result

    return RegionPlan(reads={name: full_box(meta.shape) for name, meta in group.items()}, run=run)


_T = TypeVar("_T")


class GroupIndex(Generic[_T]):
    """Finds a mapper's group (or whatever is attached to it) from the names of its inputs.

    Groups of one mapper have disjoint inputs, so the set of input names identifies a group.
    """

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._by_inputs: dict[frozenset[str], _T] = {}

    def add(self, inputs: frozenset[str], value: _T) -> None:
        if not inputs:
            raise MappingError(f"{self._owner}: a group needs at least one input")
        if inputs in self._by_inputs:
            raise MappingError(f"{self._owner}: two groups read exactly {{{describe_names(inputs)}}}")
        self._by_inputs[inputs] = value

    def find(self, names: Iterable[str]) -> _T:
        key = frozenset(names)
        found = self._by_inputs.get(key)
        if found is None:
            raise MappingError(
                f"{self._owner}: no group reads exactly {{{describe_names(key)}}}; pass the inputs of one declared "
                "group (see state_dependency_groups())"
            )
        return found
