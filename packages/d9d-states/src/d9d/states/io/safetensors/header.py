"""Parsing and checking a safetensors header without reading tensor data.

Layout: 8 bytes little-endian header length `n`, `n` bytes of JSON (`{name: {dtype, shape, data_offsets}}` plus an
optional `__metadata__`), then the data; offsets are relative to the start of the data. Every check names the file
and, where there is one, the tensor, so that a truncated download or a corrupt file is diagnosed before any data is
read.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from d9d.states.errors import CheckpointError
from d9d.states.io.safetensors.dtypes import TORCH_DTYPES
from d9d.states.meta import TensorMeta

# The reference implementation refuses headers above 100 MB; a larger length means a corrupt file, not a big model.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorEntry:
    meta: TensorMeta
    begin: int  # byte offset in the file (not in the data section)
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    tensors: dict[str, TensorEntry]  # in file order
    metadata: dict[str, str]
    data_start: int
    file_size: int

    @property
    def data_bytes(self) -> int:
        return sum(entry.end - entry.begin for entry in self.tensors.values())


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and check `path`'s header; `CheckpointError` naming the file (and tensor) on any inconsistency."""
    try:
        with path.open("rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size < 8:
                raise CheckpointError(f"{path}: truncated, {size} bytes is shorter than the 8-byte header length")
            length = int.from_bytes(file.read(8), "little")
            if length > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{path}: corrupt, header length {length} is implausible (not a safetensors file?)"
                )
            if 8 + length > size:
                raise CheckpointError(f"{path}: truncated, the header needs {8 + length} bytes but the file has {size}")
            raw = file.read(length)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from error
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: corrupt, the header is not valid JSON ({error})") from error
    if not isinstance(document, dict):
        raise CheckpointError(f"{path}: corrupt, the header is not a JSON object")
    metadata = document.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: corrupt, __metadata__ must map strings to strings")
    data_start = 8 + length
    tensors = {name: _entry(path, name, spec, data_start) for name, spec in document.items()}
    tensors = dict(sorted(tensors.items(), key=lambda item: item[1].begin))
    _check_layout(path, tensors, data_start, size)
    return SafetensorsHeader(path=path, tensors=tensors, metadata=metadata, data_start=data_start, file_size=size)


def _entry(path: Path, name: str, spec: Any, data_start: int) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(f"{where}: corrupt entry {spec!r}; expected dtype, shape and data_offsets")
    dtype = TORCH_DTYPES.get(spec["dtype"])
    if dtype is None:
        raise CheckpointError(f"{where}: unsupported dtype {spec['dtype']!r} (supported: {', '.join(TORCH_DTYPES)})")
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: corrupt shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(f"{where}: corrupt data_offsets {offsets!r}")
    meta = TensorMeta(shape=tuple(shape), dtype=dtype)
    if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(
            f"{where}: corrupt, {meta.describe()} needs {meta.nbytes} bytes but data_offsets {offsets} span "
            f"{offsets[1] - offsets[0]}"
        )
    return TensorEntry(meta=meta, begin=data_start + offsets[0], end=data_start + offsets[1])


def _check_layout(path: Path, tensors: dict[str, TensorEntry], data_start: int, size: int) -> None:
    previous: tuple[str, int] | None = None
    for name, entry in tensors.items():
        if previous is not None and entry.begin < previous[1]:
            raise CheckpointError(f"{path}: corrupt, tensors {previous[0]!r} and {name!r} overlap")
        if entry.end > size:
            raise CheckpointError(
                f"{path}: truncated, tensor {name!r} ends at byte {entry.end} but the file has {size} bytes "
                "(an interrupted download or write?)"
            )
        previous = (name, entry.end)
    end = max((entry.end for entry in tensors.values()), default=data_start)
    if end != size:
        raise CheckpointError(f"{path}: corrupt, {size - end} bytes follow the last tensor")
