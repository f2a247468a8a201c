"""Inspecting a checkpoint: every tensor, and every consistency problem at once (opening stops at the first)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from d9d.states.errors import CheckpointError, describe_names
from d9d.states.io.index import INDEX_FILE, StateIndex, read_index
from d9d.states.io.safetensors.header import SafetensorsHeader, read_header
from d9d.states.io.source import PARTIAL_SUFFIX


@dataclass(frozen=True)
class TensorRow:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str


@dataclass
class CheckpointInspection:
    root: Path
    has_index: bool = False
    file_sizes: dict[str, int] = field(default_factory=dict)
    tensors: list[TensorRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(row.nbytes for row in self.tensors)


def inspect_checkpoint(path: Path | str) -> CheckpointInspection:
    path = Path(path)
    if path.is_file():
        report = CheckpointInspection(root=path.parent)
        _add_file(report, path.name, {})
        return report
    report = CheckpointInspection(root=path)
    if not path.is_dir():
        report.problems.append(f"{path}: no such file or directory")
        return report
    report.problems += [
        f"{p.name}: partially written (a writer did not finish)" for p in sorted(path.glob(f"*{PARTIAL_SUFFIX}"))
    ]
    index: StateIndex | None = None
    if (path / INDEX_FILE).exists():
        report.has_index = True
        try:
            index = read_index(path / INDEX_FILE)
        except CheckpointError as error:
            report.problems.append(str(error))
    names = sorted({p.name for p in path.glob("*.safetensors")} | set(index.weight_map.values() if index else ()))
    if not names:
        report.problems.append(f"{path}: no .safetensors files")
    headers: dict[str, SafetensorsHeader] = {}
    for name in names:
        header = _add_file(report, name, index.weight_map if index else None)
        if header is not None:
            headers[name] = header
    if index is not None:
        _check_index(report, index, headers)
    else:
        seen: dict[str, str] = {}
        for row in report.tensors:
            if row.name in seen:
                report.problems.append(f"{row.name!r} is stored in both {seen[row.name]!r} and {row.file!r}")
            seen[row.name] = row.file
    return report


def _add_file(report: CheckpointInspection, name: str, weight_map: dict[str, str] | None) -> SafetensorsHeader | None:
    path = report.root / name
    if not path.is_file():
        return None  # reported by the index check
    report.file_sizes[name] = path.stat().st_size
    try:
        header = read_header(path)
    except CheckpointError as error:
        report.problems.append(str(error))
        return None
    for tensor, entry in header.tensors.items():
        if weight_map is None or weight_map.get(tensor) == name:
            dtype = str(entry.meta.dtype).removeprefix("torch.")
            report.tensors.append(TensorRow(tensor, dtype, entry.meta.shape, entry.meta.nbytes, name))
    return header


def _check_index(report: CheckpointInspection, index: StateIndex, headers: dict[str, SafetensorsHeader]) -> None:
    by_file: dict[str, list[str]] = {}
    for tensor, name in index.weight_map.items():
        by_file.setdefault(name, []).append(tensor)
    for name, tensors in sorted(by_file.items()):
        if not (report.root / name).is_file():
            report.problems.append(f"{INDEX_FILE} names missing file {name!r} (for {describe_names(tensors, 3)})")
        elif name in headers:
            absent = [t for t in tensors if t not in headers[name].tensors]
            if absent:
                report.problems.append(f"{INDEX_FILE} places {describe_names(absent, 3)} in {name!r}, which lacks them")
    for name, header in headers.items():
        unlisted = [t for t in header.tensors if t not in index.weight_map]
        if unlisted:
            report.problems.append(f"{name!r} holds {describe_names(unlisted, 3)}, which {INDEX_FILE} does not list")
    declared = index.metadata.total_size
    if declared is not None and not report.problems and declared != report.total_bytes:
        report.problems.append(f"{INDEX_FILE} declares total_size {declared} but the tensors take {report.total_bytes}")
