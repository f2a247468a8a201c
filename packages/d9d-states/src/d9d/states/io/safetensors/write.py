"""Writing a safetensors file whose tensors are all known in advance, one tensor at a time.

`save_file` needs every tensor in memory at once and copies each into a bytes object. Here the header is written
first from the planned metadata, then each tensor is written at its offset as soon as it is produced and can be
freed: memory stays at one tensor, and the bytes go from the tensor's memory to the file with no copy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from d9d.states.errors import StateMismatchError
from d9d.states.io.safetensors.copy import ByteCopier, paired_runs
from d9d.states.io.safetensors.dtypes import safetensors_dtype
from d9d.states.io.safetensors.read import byte_runs
from d9d.states.meta import Box, TensorMeta, box_numel

_ALIGNMENT = 8  # the data section starts 8-byte aligned, as the reference writer does


def encode_header(tensors: Sequence[tuple[str, TensorMeta]], metadata: Mapping[str, str]) -> tuple[bytes, list[int]]:
    """The header bytes (length prefix included) and each tensor's start offset in the file."""
    document: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    relative = []
    for name, meta in tensors:
        relative.append(offset)
        document[name] = {
            "dtype": safetensors_dtype(meta.dtype, tensor=name),
            "shape": list(meta.shape),
            "data_offsets": [offset, offset + meta.nbytes],
        }
        offset += meta.nbytes
    raw = json.dumps(document, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGNMENT)
    header = len(raw).to_bytes(8, "little") + raw
    return header, [len(header) + start for start in relative]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, without a copy when it is already contiguous on the CPU."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


class FileWriter:
    """One safetensors file being written; `write` each planned tensor once, in any order, then `close`."""

    def __init__(self, path: Path, tensors: Sequence[tuple[str, TensorMeta]], metadata: Mapping[str, str]) -> None:
        self.path = path
        header, offsets = encode_header(tensors, metadata)
        self._slots = {name: (offset, meta) for (name, meta), offset in zip(tensors, offsets, strict=True)}
        self._pending = set(self._slots)
        self._copied = dict.fromkeys(self._slots, 0)  # bytes of each tensor filled by `copy_region` so far
        self.size = len(header) + sum(meta.nbytes for _, meta in tensors)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._write_at(memoryview(header), 0)

    @property
    def done(self) -> bool:
        return not self._pending

    def write(self, name: str, tensor: torch.Tensor) -> None:
        offset, meta = self._slots[name]
        if name not in self._pending:
            raise StateMismatchError(f"{self.path}: tensor {name!r} written twice")
        if TensorMeta.of(tensor) != meta:
            raise StateMismatchError(
                f"{self.path}: tensor {name!r} was planned as {meta.describe()} but is "
                f"{TensorMeta.of(tensor).describe()}; a mapper produced something other than it declared"
            )
        self._write_at(tensor_bytes(tensor), offset)
        self._pending.discard(name)

    def copy_region(
        self, name: str, box: Box, source_fd: int, source_runs: Iterable[tuple[int, int]], copier: ByteCopier
    ) -> None:
        """Fill the part `box` of tensor `name` with bytes copied from `source_fd` at `source_runs` (in order)."""
        offset, meta = self._slots[name]
        if name not in self._pending:
            raise StateMismatchError(f"{self.path}: tensor {name!r} written twice")
        targets = ((offset + start, length) for start, length in byte_runs(meta.shape, meta.dtype.itemsize, box))
        for source, target, length in paired_runs(source_runs, targets):
            copier.copy(source_fd, source, self._fd, target, length)
        self._copied[name] += box_numel(box) * meta.dtype.itemsize
        if self._copied[name] > meta.nbytes:
            raise StateMismatchError(f"{self.path}: tensor {name!r} received more bytes than it has")
        if self._copied[name] == meta.nbytes:
            self._pending.discard(name)

    def _write_at(self, data: memoryview, offset: int) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], offset + done)

    def close(self, *, sync: bool = True) -> None:
        """Close the file, fsync'ed unless `sync=False` (an aborted write)."""
        if self._fd < 0:
            return
        try:
            if sync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1
