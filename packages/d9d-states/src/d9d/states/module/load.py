"""Loading a checkpoint into a module's parameters and buffers, DTensor shards read directly from disk."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from d9d.states.engine.plan import StatePlan, plan_states
from d9d.states.engine.stream import StateStream
from d9d.states.errors import StateMismatchError, describe_names
from d9d.states.io.source import CheckpointSource
from d9d.states.mapper.api import ModelStateMapper
from d9d.states.mapper.compose.sequential import Sequential
from d9d.states.mapper.leaf.dtensor import Distribute
from d9d.states.mapper.leaf.rename import Identity
from d9d.states.meta import TensorMeta, is_dtensor


@dataclass(frozen=True)
class LoadReport:
    tensors: int
    groups: int
    bytes_read: int
    largest_group_bytes: int
    seconds: float


def read_model_state(
    source: Path | str, mapper: ModelStateMapper, *, allow_unused: bool = False, progress: bool | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `(name, tensor)` pairs that `mapper` makes of the checkpoint at `source`, one group at a time.

    With `Distribute` in the mapper, each rank reads only its shards and gets DTensors.
    """
    checkpoint = CheckpointSource.open(source)
    plan = _plan(checkpoint, mapper, allow_unused=allow_unused)
    yield from StateStream(checkpoint, mapper, plan, progress=progress)


def load_model_state(
    source: Path | str,
    module: nn.Module,
    mapper: ModelStateMapper | None = None,
    *,
    strict: bool = True,
    allow_unused: bool = False,
    progress: bool | None = None,
) -> LoadReport:
    """Copy the checkpoint at `source`, mapped by `mapper` (default: names as they are), into `module`'s state.

    DTensor parameters are filled from their shard only: each rank reads the bytes of its shards and of replicated
    tensors, nothing else, and no collective runs. Raises `StateMismatchError` before reading any data when the
    mapping produces names the module lacks, misses names it has (unless `strict=False`), or produces a shape or
    dtype other than the module's; and when the checkpoint has tensors the mapping ignores (unless `allow_unused`).
    """
    start = time.perf_counter()
    targets = module.state_dict()
    mapper = mapper or Identity(list(targets))
    # Only the names the mapping produces are distributed: with strict=False the module may hold DTensors the
    # checkpoint never has (LoRA adapters injected into a sharded base), and those must not be read from it.
    produced = {name for group in mapper.state_dependency_groups() for name in group.outputs}
    dtensors = {name: tensor for name, tensor in targets.items() if is_dtensor(tensor) and name in produced}
    full = Sequential([mapper, Distribute.like(dtensors)]) if dtensors else mapper
    checkpoint = CheckpointSource.open(source)
    plan = _plan(checkpoint, full, allow_unused=allow_unused)
    _check_targets(plan, targets, checkpoint, strict=strict)
    stream = StateStream(checkpoint, full, plan, progress=progress, description="loading")
    with torch.no_grad():
        for name, value in stream:
            target = targets[name]
            if is_dtensor(target) and is_dtensor(value):
                target.to_local().copy_(value.to_local())  # this rank's shard, read from disk, nothing more
            else:
                target.copy_(value)
    return LoadReport(
        tensors=stream.stats.tensors,
        groups=stream.stats.groups,
        bytes_read=stream.stats.bytes_read,
        largest_group_bytes=plan.largest_group_bytes,
        seconds=time.perf_counter() - start,
    )


def _plan(checkpoint: CheckpointSource, mapper: ModelStateMapper, *, allow_unused: bool) -> StatePlan:
    return plan_states(
        mapper,
        checkpoint.metas(),
        source=checkpoint.describe(),
        where=checkpoint.where,
        position=checkpoint.position,
        allow_unused=allow_unused,
    )


def _check_targets(
    plan: StatePlan, targets: Mapping[str, torch.Tensor], checkpoint: CheckpointSource, *, strict: bool
) -> None:
    produced = plan.outputs()
    unexpected = produced.keys() - targets.keys()
    if unexpected:
        raise StateMismatchError(
            f"unexpected keys: the mapping of {checkpoint.root} produces {describe_names(unexpected)}, which the "
            "module does not have"
        )
    missing = targets.keys() - produced.keys()
    if missing and strict:
        raise StateMismatchError(
            f"missing keys: the module has {describe_names(missing)}, which the mapping of {checkpoint.root} does "
            "not produce (pass strict=False to load a part of the module)"
        )
    origin = {name: planned for planned in plan.groups for name in planned.outputs}
    mismatches = []
    for name, meta in produced.items():
        expected = TensorMeta.of(targets[name])
        if meta != expected:
            inputs = ", ".join(f"{source!r} in {checkpoint.where(source)}" for source in list(origin[name].inputs)[:2])
            mismatches.append(
                f"{name!r}: the module has {expected.describe()}, the mapped checkpoint {meta.describe()} "
                f"(from {inputs})"
            )
    if mismatches:
        more = f" and {len(mismatches) - 5} more" if len(mismatches) > 5 else ""
        raise StateMismatchError(
            "shape or dtype mismatch: "
            + "; ".join(mismatches[:5])
            + more
            + " (add Transpose, CastDtype, ... to the mapping)"
        )
