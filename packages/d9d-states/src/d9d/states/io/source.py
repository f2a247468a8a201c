"""A checkpoint on disk: its files, where each tensor lives, and every consistency check done up front.

Accepted layouts: a directory with `model.safetensors.index.json` and the shards it names (Hugging Face), a
directory of `*.safetensors` files without an index (tensor names must then be unique across files), or one
`.safetensors` file. Only headers are read when opening; tensor data is read later, as groups need it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from d9d.states.errors import CheckpointError, describe_names
from d9d.states.io.index import INDEX_FILE, StateIndex, read_index
from d9d.states.io.safetensors.header import SafetensorsHeader, TensorEntry, read_header
from d9d.states.io.safetensors.read import FileReader
from d9d.states.meta import Box, TensorMeta

PARTIAL_SUFFIX = ".partial"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class CheckpointSource:
    root: Path
    headers: dict[str, SafetensorsHeader]  # by file name, in a stable order
    locations: dict[str, str]  # tensor name -> file name
    index: StateIndex | None

    @classmethod
    def open(cls, path: Path | str) -> CheckpointSource:
        """Open and check a checkpoint; `CheckpointError` naming the file and tensor on any inconsistency."""
        path = Path(path)
        if path.is_file():
            if path.suffix != ".safetensors":
                raise CheckpointError(f"{path}: not a .safetensors file{_pickle_hint(path)}")
            header = read_header(path)
            return cls(path.parent, {path.name: header}, dict.fromkeys(header.tensors, path.name), None)
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such checkpoint (neither a directory nor a .safetensors file)")
        partial = sorted(p.name for p in path.glob(f"*{PARTIAL_SUFFIX}"))
        if partial:
            raise CheckpointError(
                f"{path}: holds partially written files ({', '.join(partial[:3])}); a writer did not finish, so this "
                "is not a complete checkpoint"
            )
        if (path / INDEX_FILE).exists():
            return cls._from_index(path)
        return cls._from_files(path)

    @classmethod
    def _from_index(cls, root: Path) -> CheckpointSource:
        index = read_index(root / INDEX_FILE)
        by_file: dict[str, list[str]] = {}
        for tensor, file_name in index.weight_map.items():
            by_file.setdefault(file_name, []).append(tensor)
        missing = {name: tensors for name, tensors in by_file.items() if not (root / name).is_file()}
        if missing:
            name, tensors = sorted(missing.items())[0]
            raise CheckpointError(
                f"{root / INDEX_FILE}: names {len(missing)} missing file(s), e.g. {name!r} (for tensors "
                f"{describe_names(tensors, 3)}); the checkpoint is incomplete"
            )
        headers = {name: read_header(root / name) for name in sorted(by_file)}
        for file_name, tensors in by_file.items():
            absent = [t for t in tensors if t not in headers[file_name].tensors]
            if absent:
                raise CheckpointError(
                    f"{root / INDEX_FILE}: places {describe_names(absent, 3)} in {file_name!r}, but "
                    f"{root / file_name} has no such tensor"
                )
        return cls(root, headers, dict(index.weight_map), index)

    @classmethod
    def _from_files(cls, root: Path) -> CheckpointSource:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
            hint = f"; found {', '.join(pickles[:3])}{_pickle_hint(root / pickles[0])}" if pickles else ""
            raise CheckpointError(f"{root}: no .safetensors files and no {INDEX_FILE}{hint}")
        headers = {path.name: read_header(path) for path in files}
        locations: dict[str, str] = {}
        for file_name, header in headers.items():
            for tensor in header.tensors:
                if tensor in locations:
                    raise CheckpointError(
                        f"{root}: tensor {tensor!r} is stored in both {locations[tensor]!r} and {file_name!r}, and "
                        f"there is no {INDEX_FILE} to say which one counts"
                    )
                locations[tensor] = file_name
        return cls(root, headers, locations, None)

    # Queries ------------------------------------------------------------------------------------------------------

    def entry(self, name: str) -> TensorEntry:
        return self.headers[self.locations[name]].tensors[name]

    def metas(self) -> dict[str, TensorMeta]:
        return {name: self.entry(name).meta for name in self.locations}

    def position(self, name: str) -> tuple[int, int]:
        """Where a tensor lies: (file number, byte offset); reading in this order reads each file front to back."""
        return self._file_numbers[self.locations[name]], self.entry(name).begin

    @functools.cached_property
    def _file_numbers(self) -> dict[str, int]:
        return {name: number for number, name in enumerate(self.headers)}

    def where(self, name: str) -> str:
        return f"{self.root / self.locations[name]}"

    def describe(self) -> str:
        return f"{self.root} ({len(self.locations)} tensors in {len(self.headers)} files)"

    def open_reader(self) -> SourceReader:
        return SourceReader(self)


class SourceReader:
    """Reads tensors (or boxes of them) from a source, opening each file on first use. Use as a context manager."""

    def __init__(self, source: CheckpointSource) -> None:
        self._source = source
        self._files: dict[str, FileReader] = {}

    @property
    def bytes_read(self) -> int:
        return sum(reader.bytes_read for reader in self._files.values())

    def read(self, name: str, box: Box | None = None) -> torch.Tensor:
        """Tensor `name` whole, or the part of it inside `box`."""
        return self._file(name).read(name, self._source.entry(name), box)

    def read_into(self, name: str, box: Box, out: torch.Tensor) -> None:
        """The part of tensor `name` inside `box` into `out` (contiguous, as many elements, same dtype)."""
        self._file(name).read_into(name, self._source.entry(name), box, out)

    def runs(self, name: str, box: Box) -> tuple[int, list[tuple[int, int]]]:
        """The file descriptor holding tensor `name` and the byte runs of its part inside `box`."""
        return self._file(name).runs(self._source.entry(name), box)

    def _file(self, name: str) -> FileReader:
        file_name = self._source.locations[name]
        reader = self._files.get(file_name)
        if reader is None:
            reader = self._files[file_name] = FileReader(self._source.root / file_name)
        return reader

    def close(self) -> None:
        for reader in self._files.values():
            reader.close()
        self._files.clear()

    def __enter__(self) -> SourceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pickle_hint(path: Path) -> str:
    if path.suffix in _PICKLE_SUFFIXES:
        return (
            f" ({path.suffix} files are pickles, which d9d.states never loads because unpickling runs code; "
            "convert them to safetensors with their authors' tools first)"
        )
    return ""
