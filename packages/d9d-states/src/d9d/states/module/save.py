"""Saving a module's state (DTensors included) as a sharded safetensors checkpoint, from one or more ranks."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from d9d.states.engine.plan import PlannedGroup, plan_states
from d9d.states.engine.ranks import Ranks
from d9d.states.engine.schedule import assign_groups
from d9d.states.engine.staged import write_staged
from d9d.states.errors import MappingError
from d9d.states.io.shards import DEFAULT_SHARD_BYTES, ShardedWriter, WrittenFile
from d9d.states.mapper.api import ModelStateMapper
from d9d.states.mapper.leaf.rename import Identity
from d9d.states.meta import TensorMeta, is_dtensor
from d9d.states.progress import progress_bar


@dataclass(frozen=True)
class SaveReport:
    files: list[str]
    groups: int
    bytes_written: int
    seconds: float


def save_model_state(
    destination: Path | str,
    state: nn.Module | Mapping[str, torch.Tensor],
    mapper: ModelStateMapper | None = None,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> SaveReport:
    """Write `state` (a module's `state_dict()` or a mapping), mapped by `mapper`, as a checkpoint at `destination`.

    Distributed (a process group given, or the default one): call on every rank with the same state names. Groups
    are split across ranks by size and each rank writes its share; DTensor inputs are gathered group by group (a
    collective every rank joins), so memory holds one group at a time. The first rank publishes the index, and
    `destination` appears only when every rank has finished.
    """
    start = time.perf_counter()
    tensors = dict(state.state_dict() if isinstance(state, nn.Module) else state)
    mapper = mapper or Identity(list(tensors))
    metas = {name: TensorMeta.of(tensor) for name, tensor in tensors.items()}
    plan = plan_states(mapper, metas, source="the state to save")
    ranks = Ranks.current(process_group)
    owned = assign_groups(plan, ranks.size)[ranks.rank]
    mine = plan.subset(owned)
    written = 0

    def write(staging: Path) -> list[WrittenFile]:
        nonlocal written
        writer = ShardedWriter(staging, mine.outputs(), max_shard_bytes=max_shard_bytes, stem=f"part-{ranks.rank:05d}")
        bar = progress_bar(mine.output_bytes, "saving", enabled=progress and ranks.is_first)
        try:
            with bar:
                # Every rank walks every group in the same order: gathering a DTensor is a collective.
                for planned in plan.groups:
                    inputs = _gather(planned, tensors, needed=planned.group in owned)
                    if planned.group not in owned:
                        continue
                    outputs = mapper.apply(inputs)
                    del inputs
                    _check(planned, outputs)
                    for name in sorted(outputs):
                        writer.write(name, outputs.pop(name))
                        bar.update(planned.outputs[name].nbytes)
        finally:
            writer.abort()
        written = writer.bytes_written
        return writer.finish()

    files = write_staged(Path(destination), ranks, write, overwrite=overwrite)
    return SaveReport(files=files, groups=len(mine.groups), bytes_written=written, seconds=time.perf_counter() - start)


def _gather(planned: PlannedGroup, tensors: Mapping[str, torch.Tensor], *, needed: bool) -> dict[str, torch.Tensor]:
    gathered = {}
    for name in planned.inputs:
        tensor = tensors[name]
        if is_dtensor(tensor):
            gathered[name] = tensor.full_tensor()  # collective over the DTensor's mesh
        elif needed:
            gathered[name] = tensor
    return gathered


def _check(planned: PlannedGroup, outputs: Mapping[str, torch.Tensor]) -> None:
    if outputs.keys() != planned.outputs.keys() or any(
        TensorMeta.of(tensor) != planned.outputs[name] for name, tensor in outputs.items()
    ):
        got = {name: TensorMeta.of(tensor).describe() for name, tensor in outputs.items()}
        want = {name: meta.describe() for name, meta in planned.outputs.items()}
        raise MappingError(f"group {planned.group.describe()} produced {got}, but its mapper inferred {want}")
