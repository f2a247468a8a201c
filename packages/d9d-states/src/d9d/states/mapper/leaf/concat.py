"""Concatenating tensors along an existing dimension (fusing q/k/v), and splitting one back into parts."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

from d9d.states.errors import MappingError
from d9d.states.mapper.api import RegionPlan, Tensors
from d9d.states.mapper.checks import check_names
from d9d.states.mapper.copies import Copy
from d9d.states.mapper.leaf.op import Op, OpMapper
from d9d.states.meta import Box, TensorMeta, bounding_box, box_numel, box_shape, normalize_dim, shift


def _offsets(sizes: Sequence[int]) -> list[int]:
    return [0, *itertools.accumulate(sizes)]


class ConcatenateOp(Op):
    def __init__(self, inputs: Sequence[str], output: str, dim: int) -> None:
        if not inputs:
            raise MappingError(f"Concatenate into {output!r}: needs at least one input")
        self.inputs = check_names(inputs, what=f"Concatenate into {output!r}")
        self.outputs = (output,)
        self.dim = dim

    def _layout(self, metas: Mapping[str, TensorMeta]) -> tuple[int, TensorMeta, list[int]]:
        """The concatenated dimension, the output metadata and each input's start offset along it."""
        first = metas[self.inputs[0]]
        dim = normalize_dim(self.dim, len(first.shape), what=f"Concatenate into {self.outputs[0]!r}")
        for name in self.inputs[1:]:
            meta = metas[name]
            other_dims_differ = meta.shape[:dim] + meta.shape[dim + 1 :] != first.shape[:dim] + first.shape[dim + 1 :]
            if meta.dtype != first.dtype or len(meta.shape) != len(first.shape) or other_dims_differ:
                raise MappingError(
                    f"Concatenate into {self.outputs[0]!r} along dimension {self.dim}: {name!r} is "
                    f"{meta.describe()} but {self.inputs[0]!r} is {first.describe()}; all dimensions but {self.dim} "
                    "and the dtype must agree"
                )
        sizes = [metas[name].shape[dim] for name in self.inputs]
        shape = (*first.shape[:dim], sum(sizes), *first.shape[dim + 1 :])
        return dim, TensorMeta(shape=shape, dtype=first.dtype), _offsets(sizes)

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> Tensors:
        return {self.outputs[0]: torch.cat([tensors[name] for name in self.inputs], dim=self.dim)}

    def infer(self, metas: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        return {self.outputs[0]: self._layout(metas)[1]}

    def plan_regions(self, metas: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan | None:
        output = self.outputs[0]
        if output not in wanted:
            return RegionPlan(reads={}, run=lambda _: {}, copies=())
        dim, meta, offsets = self._layout(metas)
        box = wanted[output]
        start, stop = box[dim]
        reads: dict[str, Box] = {}
        copies: list[Copy] = []
        for name, begin, end in zip(self.inputs, offsets, offsets[1:], strict=False):
            low, high = max(start, begin), min(stop, end)
            if low < high:
                reads[name] = (*box[:dim], (low - begin, high - begin), *box[dim + 1 :])
                copies.append(Copy(name, reads[name], output, (*box[:dim], (low, high), *box[dim + 1 :])))
        order = [name for name in self.inputs if name in reads]

        def run(tensors: Tensors) -> Tensors:
            if not order:
                return {output: torch.empty(box_shape(box), dtype=meta.dtype)}
            return {output: torch.cat([tensors[name] for name in order], dim=dim)}

        return RegionPlan(reads=reads, run=run, copies=tuple(c for c in copies if box_numel(c.target_box) > 0))


class ChunkOp(Op):
    def __init__(self, input_name: str, outputs: Sequence[str], dim: int, sizes: Sequence[int] | None) -> None:
        self.inputs = (input_name,)
        self.outputs = check_names(outputs, what=f"Chunk of {input_name!r}")
        if not self.outputs:
            raise MappingError(f"Chunk of {input_name!r}: needs at least one output")
        if sizes is not None and len(sizes) != len(self.outputs):
            raise MappingError(
                f"Chunk of {input_name!r}: {len(sizes)} sizes given for {len(self.outputs)} outputs "
                f"{list(self.outputs)}"
            )
        self.dim = dim
        self.sizes = None if sizes is None else tuple(sizes)

    def _layout(self, meta: TensorMeta) -> tuple[int, list[int]]:
        """The split dimension and each output's start offset along it (plus the end)."""
        name = self.inputs[0]
        dim = normalize_dim(self.dim, len(meta.shape), what=f"Chunk of {name!r}")
        length = meta.shape[dim]
        sizes = self.sizes
        if sizes is None:
            if length % len(self.outputs) != 0:
                raise MappingError(
                    f"Chunk of {name!r}: dimension {self.dim} has size {length}, not divisible into "
                    f"{len(self.outputs)} equal parts; pass sizes=[...]"
                )
            sizes = (length // len(self.outputs),) * len(self.outputs)
        if sum(sizes) != length or any(size < 0 for size in sizes):
            raise MappingError(
                f"Chunk of {name!r}: sizes {list(sizes)} do not add up to dimension {self.dim} of size {length}"
            )
        return dim, _offsets(sizes)

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> Tensors:
        tensor = tensors[self.inputs[0]]
        dim, offsets = self._layout(TensorMeta.of(tensor))
        return {
            name: tensor.narrow(dim, begin, end - begin)
            for name, begin, end in zip(self.outputs, offsets, offsets[1:], strict=False)
        }

    def infer(self, metas: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        meta = metas[self.inputs[0]]
        dim, offsets = self._layout(meta)
        return {
            name: TensorMeta(shape=(*meta.shape[:dim], end - begin, *meta.shape[dim + 1 :]), dtype=meta.dtype)
            for name, begin, end in zip(self.outputs, offsets, offsets[1:], strict=False)
        }

    def plan_regions(self, metas: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan | None:
        meta = metas[self.inputs[0]]
        dim, offsets = self._layout(meta)
        begin_of = dict(zip(self.outputs, offsets, strict=False))
        boxes = {
            name: (*box[:dim], (box[dim][0] + begin_of[name], box[dim][1] + begin_of[name]), *box[dim + 1 :])
            for name, box in wanted.items()
            if box_numel(box) > 0
        }

        def empty(box: Box) -> torch.Tensor:
            return torch.empty(box_shape(box), dtype=meta.dtype)

        if not boxes:
            return RegionPlan(reads={}, run=lambda _: {name: empty(box) for name, box in wanted.items()}, copies=())
        # One read covering every wanted part. Parts of a fused tensor sharded alike lie apart along `dim`, so this
        # may read more than needed; exact for the sharded dimensions that are not `dim`.
        region = bounding_box(list(boxes.values()))

        def run(tensors: Tensors) -> Tensors:
            loaded = tensors[self.inputs[0]]
            return {
                name: loaded[tuple(slice(a, b) for a, b in shift(boxes[name], region))] if name in boxes else empty(box)
                for name, box in wanted.items()
            }

        copies = tuple(Copy(self.inputs[0], boxes[name], name, wanted[name]) for name in boxes)
        return RegionPlan(reads={self.inputs[0]: region}, run=run, copies=copies)


class Concatenate(OpMapper):
    """Concatenate `inputs` into `output` along the existing dimension `dim` (e.g. q, k, v into qkv).

    Loading a DTensor sharded along any dimension reads only the matching parts of each input.
    """

    def __init__(self, inputs: Sequence[str], output: str, dim: int = 0) -> None:
        super().__init__([ConcatenateOp(inputs, output, dim)])


class Chunk(OpMapper):
    """Split `input_name` along `dim` into `outputs`: equal parts, or `sizes` (e.g. q, k, v of unequal widths)."""

    def __init__(
        self, input_name: str, outputs: Sequence[str], dim: int = 0, sizes: Sequence[int] | None = None
    ) -> None:
        super().__init__([ChunkOp(input_name, outputs, dim, sizes)])
