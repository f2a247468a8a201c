"""Moving a plan's groups from a source checkpoint into a sharded writer, one group at a time.

A group that only moves bytes is copied file to file by the kernel (`copy_file_range`, as `cp` does): its data never
enters this process. Any other group is read into memory, computed and written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from d9d.states.engine.plan import PlannedGroup
from d9d.states.engine.stream import assemblable, produce, whole
from d9d.states.io.shards import ShardedWriter
from d9d.states.io.source import SourceReader
from d9d.states.mapper.api import ModelStateMapper


def transfer_groups(
    reader: SourceReader,
    writer: ShardedWriter,
    mapper: ModelStateMapper,
    groups: Sequence[PlannedGroup],
    *,
    copy_in_kernel: bool,
    done: Callable[[PlannedGroup], None],
) -> None:
    """Write every output of `groups` into `writer`; `done(group)` after each group is written."""
    for planned in groups:
        wanted = whole(planned)
        region_plan = mapper.plan_regions(planned.inputs, wanted)
        if copy_in_kernel and assemblable(planned, region_plan, wanted):
            for copy in region_plan.copies or ():
                fd, runs = reader.runs(copy.source, copy.source_box)
                writer.copy_region(copy.target, copy.target_box, fd, runs)
        else:
            outputs = produce(reader, mapper, planned, region_plan)
            for name in sorted(outputs):
                writer.write(name, outputs.pop(name))
        done(planned)
