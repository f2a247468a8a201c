"""Converting a checkpoint on disk into another through a mapping, streaming, on one or more ranks."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from d9d.states.engine.plan import PlannedGroup, StatePlan, plan_states
from d9d.states.engine.ranks import Ranks
from d9d.states.engine.schedule import assign_groups
from d9d.states.engine.staged import write_staged
from d9d.states.engine.transfer import transfer_groups
from d9d.states.errors import CheckpointError
from d9d.states.io.shards import DEFAULT_SHARD_BYTES, ShardedWriter, WrittenFile
from d9d.states.io.source import CheckpointSource
from d9d.states.mapper.api import ModelStateMapper
from d9d.states.meta import TensorMeta
from d9d.states.progress import progress_bar

MappingFactory = Callable[[Mapping[str, TensorMeta]], ModelStateMapper]


@dataclass(frozen=True)
class ConvertReport:
    """What one rank did (`bytes_read`, `bytes_written`, `groups`) and what the whole plan looked like."""

    files: list[str]
    groups: int
    bytes_read: int
    bytes_written: int
    largest_group_bytes: int
    seconds: float


def convert_checkpoint(
    source: Path | str,
    destination: Path | str,
    mapping: ModelStateMapper | MappingFactory,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    allow_unused: bool = False,
    progress: bool | None = None,
    process_group: dist.ProcessGroup | None = None,
    copy_in_kernel: bool = True,
) -> ConvertReport:
    """Read `source`, map it group by group, and write a sharded safetensors checkpoint at `destination`.

    `mapping` is a mapper, or a factory called with the source's tensor metadata. With a process group (the given
    one, else the default one if initialised) the groups are split across ranks by size; each rank reads and writes
    its share and the first rank publishes the index. `destination` appears only when complete. Memory stays near
    the largest group (inputs plus outputs). Collective when distributed: call it on every rank.

    Groups that only move bytes (renames, fusing along the leading dimension, stacking experts) are copied file to
    file by the kernel (`copy_file_range`, as `cp` does) and never enter memory; `copy_in_kernel=False` assembles
    them in memory instead.
    """
    start = time.perf_counter()
    refuse_overlap(Path(source), Path(destination))
    checkpoint, mapper, plan = _open_and_plan(source, mapping, allow_unused=allow_unused)
    ranks = Ranks.current(process_group)
    mine = plan.subset(assign_groups(plan, ranks.size)[ranks.rank]) if ranks.size > 1 else plan
    read = written = 0

    def write(staging: Path) -> list[WrittenFile]:
        nonlocal read, written
        writer = ShardedWriter(staging, mine.outputs(), max_shard_bytes=max_shard_bytes, stem=f"part-{ranks.rank:05d}")
        bar = progress_bar(mine.output_bytes, "converting", enabled=progress and ranks.is_first)
        try:
            with checkpoint.open_reader() as reader, bar:

                def done(planned: PlannedGroup) -> None:
                    bar.update(sum(meta.nbytes for meta in planned.outputs.values()))

                transfer_groups(reader, writer, mapper, mine.groups, copy_in_kernel=copy_in_kernel, done=done)
                read = reader.bytes_read
        finally:
            writer.abort()
        written = writer.bytes_written
        return writer.finish()

    files = write_staged(Path(destination), ranks, write, overwrite=overwrite)
    return ConvertReport(
        files=files,
        groups=len(mine.groups),
        bytes_read=read,
        bytes_written=written,
        largest_group_bytes=plan.largest_group_bytes,
        seconds=time.perf_counter() - start,
    )


def refuse_overlap(source: Path, destination: Path) -> None:
    """`CheckpointError` when `destination` is `source`, inside it, or holds it: publishing it (with overwrite)
    would delete the source the conversion reads. Symbolic links are followed."""
    source, destination = source.resolve(), destination.resolve()
    if destination == source:
        raise CheckpointError(f"{destination}: the destination is the source; convert into another directory")
    if destination.is_relative_to(source):
        raise CheckpointError(
            f"{destination}: the destination is inside the source {source}; convert into a directory outside it"
        )
    if source.is_relative_to(destination):
        raise CheckpointError(
            f"{destination}: the destination holds the source {source}; convert into a directory outside it"
        )


def plan_conversion(
    source: Path | str, mapping: ModelStateMapper | MappingFactory, *, allow_unused: bool = False
) -> StatePlan:
    """The checked plan of a conversion, without reading tensor data (for dry runs and sizing)."""
    return _open_and_plan(source, mapping, allow_unused=allow_unused)[2]


def _open_and_plan(
    source: Path | str, mapping: ModelStateMapper | MappingFactory, *, allow_unused: bool
) -> tuple[CheckpointSource, ModelStateMapper, StatePlan]:
    checkpoint = CheckpointSource.open(source)
    mapper = mapping if isinstance(mapping, ModelStateMapper) else mapping(checkpoint.metas())
    plan = plan_states(
        mapper,
        checkpoint.metas(),
        source=checkpoint.describe(),
        where=checkpoint.where,
        position=checkpoint.position,
        allow_unused=allow_unused,
    )
    return checkpoint, mapper, plan
