"""Making a checkpoint directory appear only when it is complete.

Shards are written as `*.partial` files into a hidden staging directory next to the destination
(`.NAME.incomplete-TOKEN`). When every rank has written and fsync'ed its shards, the first rank renames them to their
Hugging Face names, writes the index (temporary name, fsync, rename), fsyncs the directory and renames it to the
destination. A crash at any point leaves either no destination or a complete one; a staging directory left behind
holds `*.partial` files or lacks its index, and `CheckpointSource.open` refuses it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

from d9d.states.errors import CheckpointError
from d9d.states.io.index import INDEX_FILE, SINGLE_FILE, IndexMetadata, StateIndex, index_json
from d9d.states.io.safetensors.write import FileWriter
from d9d.states.io.shards import FORMAT_METADATA, WrittenFile


def new_staging_dir(destination: Path, *, overwrite: bool) -> Path:
    """Create the staging directory for `destination` (run on one rank); fails early if it may not be replaced."""
    if destination.exists() and not overwrite:
        raise CheckpointError(f"{destination}: already exists; choose a new destination or allow overwriting it")
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = destination.parent / f".{destination.name}.incomplete-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    return staging


def final_names(count: int) -> list[str]:
    """Hugging Face shard names: `model.safetensors` alone, else `model-00001-of-0000N.safetensors`."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{number:05d}-of-{count:05d}.safetensors" for number in range(1, count + 1)]


def publish(staging: Path, destination: Path, files: Sequence[WrittenFile], *, overwrite: bool) -> list[str]:
    """Name the shards, write the index, and move the staging directory into place. Returns the file names."""
    if not files:
        # An empty mapping still makes a valid (empty) checkpoint, so a reader sees "no tensors", not "no checkpoint".
        empty = WrittenFile("empty.safetensors.partial")
        FileWriter(staging / empty.name, [], FORMAT_METADATA).close()
        files = [empty]
    names = final_names(len(files))
    for written, name in zip(files, names, strict=True):
        (staging / written.name).rename(staging / name)
    if len(files) > 1:
        index = StateIndex(
            metadata=IndexMetadata(total_size=sum(sum(f.tensors.values()) for f in files)),
            weight_map={tensor: name for written, name in zip(files, names, strict=True) for tensor in written.tensors},
        )
        _write_synced(staging / INDEX_FILE, index_json(index))
    _fsync_dir(staging)
    replaced = None
    if destination.exists():
        if not overwrite:
            raise CheckpointError(f"{destination}: appeared while writing; the new checkpoint stays in {staging}")
        replaced = destination.parent / f".{destination.name}.replaced-{uuid.uuid4().hex[:12]}"
        destination.rename(replaced)
    staging.rename(destination)
    _fsync_dir(destination.parent)
    if replaced is not None:
        shutil.rmtree(replaced)
    return names


def discard(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)


def _write_synced(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    temporary.rename(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
