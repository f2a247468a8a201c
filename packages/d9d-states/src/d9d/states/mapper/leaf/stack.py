"""Stacking tensors into one along a new dimension (per-expert weights into grouped ones), and the reverse."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from d9d.states.errors import MappingError
from d9d.states.mapper.api import RegionPlan, Tensors
from d9d.states.mapper.checks import check_names
from d9d.states.mapper.copies import Copy
from d9d.states.mapper.leaf.op import Op, OpMapper
from d9d.states.meta import Box, TensorMeta, bounding_box, box_numel, box_shape, normalize_dim, shift


class StackOp(Op):
    def __init__(self, inputs: Sequence[str], output: str, dim: int) -> None:
        if not inputs:
            raise MappingError(f"Stack into {output!r}: needs at least one input")
        self.inputs = check_names(inputs, what=f"Stack into {output!r}")
        self.outputs = (output,)
        self.dim = dim

    def _dim(self, ndim: int) -> int:
        return normalize_dim(self.dim, ndim + 1, what=f"Stack into {self.outputs[0]!r}")

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> Tensors:
        return {self.outputs[0]: torch.stack([tensors[name] for name in self.inputs], dim=self.dim)}

    def infer(self, metas: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        first = metas[self.inputs[0]]
        for name in self.inputs[1:]:
            if metas[name] != first:
                raise MappingError(
                    f"Stack into {self.outputs[0]!r}: {name!r} is {metas[name].describe()} but "
                    f"{self.inputs[0]!r} is {first.describe()}; stacked tensors must have one shape and dtype"
                )
        dim = self._dim(len(first.shape))
        shape = (*first.shape[:dim], len(self.inputs), *first.shape[dim:])
        return {self.outputs[0]: TensorMeta(shape=shape, dtype=first.dtype)}

    def plan_regions(self, metas: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan | None:
        output = self.outputs[0]
        if output not in wanted:
            return RegionPlan(reads={}, run=lambda _: {}, copies=())
        meta = metas[self.inputs[0]]
        dim = self._dim(len(meta.shape))
        box = wanted[output]
        start, stop = box[dim]
        # Only the stacked inputs inside the wanted range are read: an expert-parallel rank reads its experts.
        needed = self.inputs[start:stop]
        per_input = box[:dim] + box[dim + 1 :]

        def run(tensors: Tensors) -> Tensors:
            if not needed:
                return {output: torch.empty(box_shape(box), dtype=meta.dtype)}
            return {output: torch.stack([tensors[name] for name in needed], dim=dim)}

        copies = tuple(
            Copy(name, per_input, output, (*box[:dim], (start + i, start + i + 1), *box[dim + 1 :]))
            for i, name in enumerate(needed)
            if box_numel(per_input) > 0
        )
        return RegionPlan(reads=dict.fromkeys(needed, per_input), run=run, copies=copies)


class UnstackOp(Op):
    def __init__(self, input_name: str, outputs: Sequence[str], dim: int) -> None:
        self.inputs = (input_name,)
        self.outputs = check_names(outputs, what=f"Unstack of {input_name!r}")
        self.dim = dim

    def _dim(self, meta: TensorMeta) -> int:
        dim = normalize_dim(self.dim, len(meta.shape), what=f"Unstack of {self.inputs[0]!r}")
        if meta.shape[dim] != len(self.outputs):
            raise MappingError(
                f"Unstack of {self.inputs[0]!r}: dimension {self.dim} has size {meta.shape[dim]} but "
                f"{len(self.outputs)} outputs are named"
            )
        return dim

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> Tensors:
        parts = torch.unbind(tensors[self.inputs[0]], dim=self.dim)
        return dict(zip(self.outputs, parts, strict=True))

    def infer(self, metas: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        meta = metas[self.inputs[0]]
        dim = self._dim(meta)
        part = TensorMeta(shape=meta.shape[:dim] + meta.shape[dim + 1 :], dtype=meta.dtype)
        return dict.fromkeys(self.outputs, part)

    def plan_regions(self, metas: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan | None:
        meta = metas[self.inputs[0]]
        dim = self._dim(meta)
        position = {name: index for index, name in enumerate(self.outputs)}
        boxes = {
            name: (*box[:dim], (position[name], position[name] + 1), *box[dim:])
            for name, box in wanted.items()
            if box_numel(box) > 0
        }
        if not boxes:
            return RegionPlan(
                reads={},
                run=lambda _: {name: torch.empty(box_shape(box), dtype=meta.dtype) for name, box in wanted.items()},
                copies=(),
            )
        # One read covering every wanted part; exact when the parts share their box (the usual sharded case).
        region = bounding_box(list(boxes.values()))

        def run(tensors: Tensors) -> Tensors:
            loaded = tensors[self.inputs[0]]
            result: Tensors = {}
            for name, box in wanted.items():
                if name not in boxes:
                    result[name] = torch.empty(box_shape(box), dtype=meta.dtype)
                    continue
                local = shift(boxes[name], region)
                result[name] = loaded[tuple(slice(a, b) for a, b in local)].squeeze(dim)
            return result

        copies = tuple(Copy(self.inputs[0], boxes[name], name, wanted[name]) for name in boxes)
        return RegionPlan(reads={self.inputs[0]: region}, run=run, copies=copies)


class Stack(OpMapper):
    """Stack `inputs` (same shape and dtype) into `output` along a new dimension `dim`.

    Loading a DTensor sharded along `dim` reads only the inputs of the local shard.
    """

    def __init__(self, inputs: Sequence[str], output: str, dim: int = 0) -> None:
        super().__init__([StackOp(inputs, output, dim)])


class Unstack(OpMapper):
    """Split `input_name` along dimension `dim` into one tensor per name in `outputs` (the reverse of `Stack`)."""

    def __init__(self, input_name: str, outputs: Sequence[str], dim: int = 0) -> None:
        super().__init__([UnstackOp(input_name, outputs, dim)])
