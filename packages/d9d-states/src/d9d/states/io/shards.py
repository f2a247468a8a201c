"""Writing planned outputs into size-bounded safetensors shards, each tensor as soon as it is produced."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from d9d.states.errors import StateMismatchError, describe_names
from d9d.states.io.safetensors.copy import ByteCopier
from d9d.states.io.safetensors.write import FileWriter
from d9d.states.io.source import PARTIAL_SUFFIX
from d9d.states.meta import Box, TensorMeta

DEFAULT_SHARD_BYTES = 5 * 1024**3  # what transformers' save_pretrained uses ("5GB")
FORMAT_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it


@dataclass(frozen=True)
class WrittenFile:
    """A finished (fsync'ed) shard: its name in the staging directory and the tensors in it."""

    name: str
    tensors: dict[str, int] = field(default_factory=dict)  # name -> bytes


def layout_shards(outputs: Mapping[str, TensorMeta], max_bytes: int) -> list[list[tuple[str, TensorMeta]]]:
    """Fill shards in production order up to `max_bytes`; a larger tensor gets a shard of its own (as HF does)."""
    shards: list[list[tuple[str, TensorMeta]]] = []
    size = 0
    for name, meta in outputs.items():
        if not shards or (shards[-1] and size + meta.nbytes > max_bytes):
            shards.append([])
            size = 0
        shards[-1].append((name, meta))
        size += meta.nbytes
    return shards


class ShardedWriter:
    """Writes `outputs` (in their order) into `directory/{stem}-NNNNN.safetensors.partial` files.

    A file is created when its first tensor arrives and fsync'ed and closed when its last one has been written.
    `finish` checks every planned tensor was written; the caller renames files to their final names.
    """

    def __init__(self, directory: Path, outputs: Mapping[str, TensorMeta], *, max_shard_bytes: int, stem: str) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self._directory = directory
        self._shards = layout_shards(outputs, max_shard_bytes)
        self._names = [f"{stem}-{number:05d}.safetensors{PARTIAL_SUFFIX}" for number in range(len(self._shards))]
        self._shard_of = {name: number for number, shard in enumerate(self._shards) for name, _ in shard}
        self._open: dict[int, FileWriter] = {}
        self._finished: set[int] = set()
        self._copier = ByteCopier()
        self.bytes_written = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        writer = self._writer_for(name)
        writer.write(name, tensor)
        self.bytes_written += TensorMeta.of(tensor).nbytes
        self._close_if_done(name, writer)

    def copy_region(self, name: str, box: Box, source_fd: int, source_runs: list[tuple[int, int]]) -> None:
        """Fill part `box` of output `name` straight from a source file's byte runs (see `ByteCopier`)."""
        writer = self._writer_for(name)
        writer.copy_region(name, box, source_fd, source_runs, self._copier)
        self.bytes_written += sum(length for _, length in source_runs)
        self._close_if_done(name, writer)

    def _writer_for(self, name: str) -> FileWriter:
        number = self._shard_of.get(name)
        if number is None:
            raise StateMismatchError(f"tensor {name!r} is not among the planned outputs; nothing to write it into")
        writer = self._open.get(number)
        if writer is None:
            if number in self._finished:
                raise StateMismatchError(f"tensor {name!r} written twice")
            path = self._directory / self._names[number]
            writer = self._open[number] = FileWriter(path, self._shards[number], FORMAT_METADATA)
        return writer

    def _close_if_done(self, name: str, writer: FileWriter) -> None:
        if writer.done:
            writer.close()
            number = self._shard_of[name]
            del self._open[number]
            self._finished.add(number)

    def finish(self) -> list[WrittenFile]:
        """The finished files; every planned tensor must have been written."""
        unwritten = [
            name for number, shard in enumerate(self._shards) if number not in self._finished for name, _ in shard
        ]
        if unwritten:
            self.abort()
            raise StateMismatchError(f"the writer finished without tensors {describe_names(unwritten)}")
        return [
            WrittenFile(self._names[number], {name: meta.nbytes for name, meta in shard})
            for number, shard in enumerate(self._shards)
        ]

    def abort(self) -> None:
        for writer in self._open.values():
            writer.close(sync=False)
        self._open.clear()
