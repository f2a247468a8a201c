"""Reading whole tensors or boxes of them straight into tensor memory with `preadv`.

No mmap: the bytes land in an anonymous buffer the returned tensor owns, so memory is what the live tensors need and
nothing lingers as mapped pages. A box is read as the runs of contiguous bytes it covers in row-major order, so a
rank reading its shard touches only that shard's bytes; `bytes_read` counts every byte requested from disk.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator

import torch

from d9d.states.errors import CheckpointError
from d9d.states.io.safetensors.header import TensorEntry
from d9d.states.meta import Box, box_numel, box_shape, full_box


def byte_runs(shape: tuple[int, ...], itemsize: int, box: Box) -> Iterator[tuple[int, int]]:
    """`(offset, length)` in bytes of each contiguous run of `box` within a row-major tensor, in order."""
    if box_numel(box) == 0:
        return
    ndim = len(shape)
    if ndim == 0:
        yield 0, itemsize
        return
    # `split` is the outermost dimension such that every dimension after it is taken whole: each run is one slab.
    split = ndim - 1
    while split > 0 and box[split] == (0, shape[split]):
        split -= 1
    inner = math.prod(shape[split + 1 :])
    strides = [math.prod(shape[dim + 1 :]) for dim in range(ndim)]
    length = (box[split][1] - box[split][0]) * inner * itemsize
    base = box[split][0] * strides[split]
    for outer in itertools.product(*(range(start, stop) for start, stop in box[:split])):
        element = base + sum(index * stride for index, stride in zip(outer, strides, strict=False))
        yield element * itemsize, length


class FileReader:
    """An open safetensors file; read tensors by entry. Counts the bytes it reads."""

    def __init__(self, path: os.PathLike[str] | str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        self.bytes_read = 0

    def read(self, name: str, entry: TensorEntry, box: Box | None = None) -> torch.Tensor:
        """Tensor `name` (described by `entry`) whole, or the part of it inside `box`, in a new tensor."""
        meta = entry.meta
        box = full_box(meta.shape) if box is None else box
        out = torch.empty(box_shape(box), dtype=meta.dtype)
        self.read_into(name, entry, box, out)
        return out

    def read_into(self, name: str, entry: TensorEntry, box: Box, out: torch.Tensor) -> None:
        """Read the part of tensor `name` inside `box` into `out`, a contiguous tensor of as many elements.

        `out` may be a slice of a larger tensor: this is how a fused or stacked output is assembled in place.
        """
        meta = entry.meta
        if len(box) != len(meta.shape) or any(
            not 0 <= start <= stop <= size for (start, stop), size in zip(box, meta.shape, strict=True)
        ):
            raise CheckpointError(f"{self.path}: tensor {name!r} of shape {list(meta.shape)} has no region {box}")
        if out.dtype != meta.dtype or out.numel() != box_numel(box) or not out.is_contiguous():
            raise ValueError(f"cannot read {name!r} {box} into a {out.dtype} tensor of shape {list(out.shape)}")
        view = out.reshape(-1).view(torch.uint8).numpy().data
        position = 0
        for offset, length in byte_runs(meta.shape, meta.dtype.itemsize, box):
            self._read_into(view[position : position + length], entry.begin + offset, name)
            position += length

    def runs(self, entry: TensorEntry, box: Box) -> tuple[int, list[tuple[int, int]]]:
        """This file's descriptor and the `(offset, length)` byte runs of `box`, for copying them elsewhere.

        They count as read: the bytes leave this file, if through the kernel rather than through us.
        """
        meta = entry.meta
        runs = [(entry.begin + offset, length) for offset, length in byte_runs(meta.shape, meta.dtype.itemsize, box)]
        self.bytes_read += sum(length for _, length in runs)
        return self._fd, runs

    def _read_into(self, target: memoryview, offset: int, name: str) -> None:
        done = 0
        while done < len(target):
            count = os.preadv(self._fd, [target[done:]], offset + done)
            if count == 0:
                raise CheckpointError(f"{self.path}: truncated while reading tensor {name!r} (file shrank?)")
            done += count
        self.bytes_read += done

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
