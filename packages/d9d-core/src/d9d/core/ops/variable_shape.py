"""Gathers of tensors whose shapes differ per rank (e.g. per-rank sequence lengths or sample counts).

Ranks first exchange their shapes, then every tensor is flattened and padded to the largest element count, so one
fixed-size collective moves all of them; each result is cut back to its rank's shape. All ranks must agree on the
number of dimensions and the dtype (checked, with an error naming both) since those decide the buffer layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from d9d.core.ops.objects import all_gather_object


def _exchange_shapes(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Size]:
    described = all_gather_object((tuple(tensor.shape), str(tensor.dtype)), group=group)
    ndims = {len(shape) for shape, _ in described}
    dtypes = {dtype for _, dtype in described}
    if len(ndims) != 1 or len(dtypes) != 1:
        detail = ", ".join(f"rank {rank}: shape {list(shape)} {dtype}" for rank, (shape, dtype) in enumerate(described))
        raise ValueError(
            f"variable-shape gather needs the same number of dimensions and dtype on every rank; got {detail}"
        )
    return [torch.Size(shape) for shape, _ in described]


def _padded_flat(tensor: torch.Tensor, length: int) -> torch.Tensor:
    flat = tensor.contiguous().reshape(-1)
    if flat.numel() == length:
        return flat
    padded = flat.new_zeros(length)
    padded[: flat.numel()] = flat
    return padded


def _unpad(buffers: list[torch.Tensor], shapes: list[torch.Size]) -> list[torch.Tensor]:
    return [buffer[: shape.numel()].reshape(shape) for buffer, shape in zip(buffers, shapes, strict=True)]


def all_gather_variable_shape(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank receives every rank's tensor, in rank order of `group`, each with its own shape."""
    shapes = _exchange_shapes(tensor, group)
    length = max(shape.numel() for shape in shapes)
    buffers = [tensor.new_empty(length) for _ in shapes]
    dist.all_gather(buffers, _padded_flat(tensor, length), group=group)
    return _unpad(buffers, shapes)


def gather_variable_shape(
    tensor: torch.Tensor, dst: int = 0, group: dist.ProcessGroup | None = None
) -> list[torch.Tensor] | None:
    """Rank `dst` (a global rank) receives every rank's tensor in group rank order; the others receive `None`."""
    shapes = _exchange_shapes(tensor, group)
    length = max(shape.numel() for shape in shapes)
    is_destination = dist.get_rank() == dst
    buffers = [tensor.new_empty(length) for _ in shapes] if is_destination else None
    dist.gather(_padded_flat(tensor, length), gather_list=buffers, dst=dst, group=group)
    return _unpad(buffers, shapes) if buffers is not None else None
