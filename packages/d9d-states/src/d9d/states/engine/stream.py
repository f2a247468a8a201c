"""Running a plan over a checkpoint on disk, one group at a time.

For each group, in plan order: ask the mapper which regions of which inputs produce its outputs, read exactly those
(whole tensors for a plain conversion, a rank's shard for a DTensor load), run it, hand the outputs over, and drop
everything. Nothing is kept between groups, so memory is bounded by the largest group, not by the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from d9d.states.engine.plan import PlannedGroup, StatePlan
from d9d.states.errors import MappingError
from d9d.states.io.source import CheckpointSource, SourceReader
from d9d.states.mapper.api import ModelStateMapper, RegionPlan, Tensors
from d9d.states.mapper.copies import covers
from d9d.states.meta import Box, TensorMeta, box_shape, crop, full_box, is_dtensor, shift
from d9d.states.progress import progress_bar


@dataclass
class StreamStats:
    bytes_read: int = 0
    groups: int = 0
    tensors: int = 0


class StateStream:
    """Iterate `(name, tensor)` pairs that `mapper` produces from `source`, following `plan`.

    Outputs come whole (or as DTensors, when the mapper distributes); each pair is handed over and forgotten.
    `stats` counts the bytes read from disk, groups run and tensors produced so far.
    """

    def __init__(
        self,
        source: CheckpointSource,
        mapper: ModelStateMapper,
        plan: StatePlan,
        *,
        progress: bool | None = None,
        description: str = "reading states",
    ) -> None:
        self._source = source
        self._mapper = mapper
        self._plan = plan
        self._progress = progress
        self._description = description
        self.stats = StreamStats()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        bar = progress_bar(self._plan.output_bytes, self._description, enabled=self._progress)
        with self._source.open_reader() as reader, bar:
            for planned in self._plan.groups:
                outputs = produce(reader, self._mapper, planned)
                self.stats.bytes_read = reader.bytes_read
                self.stats.groups += 1
                for name in sorted(outputs):
                    tensor = outputs.pop(name)
                    self.stats.tensors += 1
                    bar.update(planned.outputs[name].nbytes)
                    yield name, tensor
                    del tensor


def whole(planned: PlannedGroup) -> dict[str, Box]:
    """Every output of a group, whole."""
    return {name: full_box(meta.shape) for name, meta in planned.outputs.items()}


def produce(
    reader: SourceReader, mapper: ModelStateMapper, planned: PlannedGroup, region_plan: RegionPlan | None = None
) -> Tensors:
    """Read what one group needs and return its outputs; nothing else stays in memory."""
    wanted = whole(planned)
    region_plan = region_plan or mapper.plan_regions(planned.inputs, wanted)
    if assemblable(planned, region_plan, wanted):
        outputs = _assemble(reader, planned, region_plan, wanted)
    else:
        tensors: Tensors = {name: reader.read(name, box) for name, box in region_plan.reads.items()}
        # `run` takes the dict over (and may empty it), so inputs are freed as soon as they are used.
        outputs = region_plan.run(tensors)
        del tensors
    _check_outputs(planned, outputs)
    return outputs


def assemblable(planned: PlannedGroup, plan: RegionPlan, wanted: Mapping[str, Box]) -> bool:
    """Whether the outputs can be assembled from copies of input regions (same dtypes, every element covered)."""
    if plan.copies is None or not covers(plan.copies, wanted):
        return False
    return all(planned.inputs[c.source].dtype == planned.outputs[c.target].dtype for c in plan.copies)


def _assemble(reader: SourceReader, planned: PlannedGroup, plan: RegionPlan, wanted: Mapping[str, Box]) -> Tensors:
    """Allocate the outputs and read every input region straight into its place: no input tensors, no extra copy."""
    outputs = {name: torch.empty(box_shape(box), dtype=planned.outputs[name].dtype) for name, box in wanted.items()}
    for copy in plan.copies or ():
        target = crop(outputs[copy.target], shift(copy.target_box, wanted[copy.target]))
        if target.is_contiguous():
            reader.read_into(copy.source, copy.source_box, target)
        else:  # e.g. a part of a concatenation along an inner dimension: read it whole, then scatter it
            target.copy_(reader.read(copy.source, copy.source_box).reshape(target.shape))
    return outputs


def _check_outputs(planned: PlannedGroup, outputs: Tensors) -> None:
    if outputs.keys() != planned.outputs.keys():
        raise MappingError(
            f"group {planned.group.describe()} produced {sorted(outputs)} instead of {sorted(planned.outputs)}"
        )
    for name, tensor in outputs.items():
        meta = TensorMeta.of(tensor)
        if meta != planned.outputs[name]:
            kind = "DTensor" if is_dtensor(tensor) else "tensor"
            raise MappingError(
                f"group {planned.group.describe()} produced {name!r} as a {kind} of {meta.describe()}, but its "
                f"mapper inferred {planned.outputs[name].describe()}"
            )
