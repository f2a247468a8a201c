"""Read an offline wandb run's history back from its `.wandb` transaction log, with wandb's own record definitions.

The file is a leveldb-style log: a 7-byte header (`:W&B`, magic 0xBEE1, version), then 32 KiB blocks of chunks, each
with a 7-byte header (CRC-32 of type and data seeded with the type byte, little-endian length, type FULL / FIRST /
MIDDLE / LAST); a chunk never straddles a block and a block's tail shorter than a header is zero padding. Each
reassembled record is a `wandb.proto.wandb_internal_pb2.Record`. wandb 0.31 has no Python reader any more (its
writer is in Go), hence this one.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> Iterator[Any]:
    """Every complete `Record` of `path`, in order; a torn tail (the writer was killed) ends the iteration."""
    from wandb.proto import wandb_internal_pb2  # the optional backend, imported only when used

    record_type: Any = vars(wandb_internal_pb2)["Record"]  # built by protobuf at import time: no static type
    data = path.read_bytes()
    if len(data) < HEADER.size:
        return
    ident, magic, _version = HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{path}: not a wandb transaction log (header {data[: HEADER.size]!r})")
    offset, pending = HEADER.size, b""
    while offset + CHUNK.size <= len(data):
        room = BLOCK - offset % BLOCK
        if room < CHUNK.size:  # zero padding at the end of a block
            offset += room
            continue
        checksum, length, kind = CHUNK.unpack_from(data, offset)
        start, end = offset + CHUNK.size, offset + CHUNK.size + length
        if (kind == 0 and length == 0) or end > len(data):
            return
        payload = data[start:end]
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != checksum:
            raise ValueError(f"{path}: chunk at byte {offset} fails its checksum")
        offset = end
        if kind == FULL:
            pending = b""
            yield record_type.FromString(payload)
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield record_type.FromString(pending + payload)
            pending = b""
        else:
            raise ValueError(f"{path}: chunk at byte {offset} has unknown type {kind}")


def read_history(path: Path) -> list[dict[str, Any]]:
    """The history rows of one `.wandb` file, values JSON-decoded, with `_step`."""
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        if record.history.HasField("step"):
            row.setdefault("_step", record.history.step.num)
        rows.append(row)
    return rows


def read_run_id(path: Path) -> str | None:
    """The run id of the `run` record of one `.wandb` file."""
    for record in read_records(path):
        if record.WhichOneof("record_type") == "run":
            return str(record.run.run_id)
    return None
