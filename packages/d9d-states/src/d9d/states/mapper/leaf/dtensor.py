"""Crossing between full tensors and DTensors: distribute onto a mesh, gather back to a full tensor."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from d9d.states.errors import MappingError
from d9d.states.mapper.api import RegionPlan, Tensors
from d9d.states.mapper.checks import check_names
from d9d.states.mapper.leaf.op import OpMapper, UnaryOp, as_names
from d9d.states.meta import Box, TensorMeta, is_dtensor, is_full

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement

# torch.distributed.tensor is imported where it is used: importing it costs about 2 s, which a conversion that never
# touches a DTensor (the command line) should not pay.


def local_box(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> Box:
    """The region of a global tensor of `shape` that this rank holds under `placements` on `mesh`."""
    # Private but stable since torch 2.4; it is what DTensor itself uses to find a rank's shard of an uneven split.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(tuple(shape), mesh, tuple(placements))
    return tuple((start, start + size) for start, size in zip(offset, local_shape, strict=True))


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        stride[dim] = stride[dim + 1] * max(shape[dim + 1], 1)
    return tuple(stride)


class DistributeOp(UnaryOp):
    def __init__(self, name: str, mesh: DeviceMesh, placements: Sequence[Placement]) -> None:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        super().__init__(name, name)
        unsupported = [p for p in placements if type(p) not in (Shard, Replicate, _StridedShard)]
        if unsupported:
            raise MappingError(
                f"Distribute {name!r}: placements {unsupported} cannot be built from a full tensor; use Shard(dim) "
                "or Replicate()"
            )
        # FSDP over a tensor-parallel split of the same dimension (`_StridedShard`): a rank's shard is several strided
        # pieces, not one box; such a tensor is read whole and sliced in memory (bounded by its group all the same).
        self.strided = any(type(p) is _StridedShard for p in placements)
        if len(placements) != mesh.ndim:
            raise MappingError(
                f"Distribute {name!r}: {len(placements)} placements for a mesh of {mesh.ndim} dimensions"
            )
        self.mesh = mesh
        self.placements = tuple(placements)

    def transform(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import distribute_tensor

        # Every rank holds the same full tensor (it read the same checkpoint): slice locally, communicate nothing.
        return distribute_tensor(tensor, self.mesh, self.placements, src_data_rank=None)

    def infer_one(self, meta: TensorMeta) -> TensorMeta:
        from torch.distributed.tensor import Shard

        for placement in self.placements:
            if isinstance(placement, Shard) and not -len(meta.shape) <= placement.dim < len(meta.shape):
                raise MappingError(
                    f"Distribute {self.source!r}: {placement} does not fit a tensor of shape {list(meta.shape)}"
                )
        return meta

    def input_box(self, output_box: Box, meta: TensorMeta) -> Box:
        if not is_full(output_box, meta.shape):
            raise MappingError(f"Distribute {self.source!r}: a DTensor is produced whole; it cannot be cropped")
        if self.strided:
            return tuple((0, size) for size in meta.shape)
        return local_box(meta.shape, self.mesh, self.placements)

    def plan_regions(self, metas: Mapping[str, TensorMeta], wanted: Mapping[str, Box]) -> RegionPlan | None:
        if self.target not in wanted:
            return RegionPlan(reads={}, run=lambda _: {})
        meta = self.infer_one(metas[self.source])
        reads = {self.source: self.input_box(wanted[self.target], meta)}

        def run(tensors: Tensors) -> Tensors:
            from torch.distributed.tensor import DTensor, distribute_tensor

            if self.strided:
                return {
                    self.target: distribute_tensor(tensors[self.source], self.mesh, self.placements, src_data_rank=None)
                }
            local = tensors[self.source].contiguous()
            dtensor = DTensor.from_local(
                local,
                self.mesh,
                self.placements,
                run_check=False,
                shape=torch.Size(meta.shape),
                stride=_contiguous_stride(meta.shape),
            )
            return {self.target: dtensor}

        return RegionPlan(reads=reads, run=run)


class Distribute(OpMapper):
    """Turn full tensors into DTensors with `placements` on `mesh` (Shard, Replicate, and FSDP's `_StridedShard` over
    a tensor-parallel split, which is read whole and sliced in memory).

    Loading through it reads only each rank's shard from disk (plain placements); `apply` on an in-memory full tensor
    slices locally.
    """

    def __init__(self, names: str | Iterable[str], mesh: DeviceMesh, placements: Sequence[Placement]) -> None:
        super().__init__(
            [DistributeOp(name, mesh, placements) for name in check_names(as_names(names), what="Distribute")]
        )

    @classmethod
    def like(cls, tensors: Mapping[str, DTensor]) -> OpMapper:
        """Distribute each name like the DTensor of that name (e.g. a model's sharded parameters)."""
        return OpMapper([DistributeOp(name, tensor.device_mesh, tensor.placements) for name, tensor in tensors.items()])


class GatherOp(UnaryOp):
    def transform(self, tensor: torch.Tensor) -> torch.Tensor:
        # A collective over the DTensor's mesh: every rank of it must gather the same names in the same order.
        return tensor.full_tensor() if is_dtensor(tensor) else tensor

    def infer_one(self, meta: TensorMeta) -> TensorMeta:
        return meta

    def input_box(self, output_box: Box, meta: TensorMeta) -> Box:
        return output_box

    def moves_only(self, meta: TensorMeta) -> bool:
        return True  # what is read from disk is never a DTensor: gathering it is the identity


class GatherFullTensor(OpMapper):
    """Turn DTensors into full tensors on every rank (plain tensors pass unchanged)."""

    def __init__(self, names: str | Iterable[str]) -> None:
        super().__init__([GatherOp(name, name) for name in check_names(as_names(names), what="GatherFullTensor")])
