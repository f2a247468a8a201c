"""`d9d-states inspect`: every tensor of a checkpoint, and every consistency problem found."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from d9d.states.io.inspect import CheckpointInspection, inspect_checkpoint


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def format_inspection(report: CheckpointInspection) -> str:
    summary = (
        f"{report.root}: {len(report.tensors)} tensors, {_size(report.total_bytes)} in "
        f"{len(report.file_sizes)} files ({'with' if report.has_index else 'no'} index)"
    )
    lines = [summary]
    width = max((len(row.name) for row in report.tensors), default=4)
    lines.append(f"{'name':<{width}}  {'dtype':<9} {'shape':<22} {'MiB':>10}  file")
    for row in sorted(report.tensors, key=lambda r: r.name):
        shape = "[" + ", ".join(map(str, row.shape)) + "]"
        lines.append(f"{row.name:<{width}}  {row.dtype:<9} {shape:<22} {row.nbytes / 2**20:>10.3f}  {row.file}")
    lines += [f"problem: {problem}" for problem in report.problems] or ["consistent: every check passed"]
    return "\n".join(lines)


def run_inspect(path: Path, *, as_json: bool) -> int:
    report = inspect_checkpoint(path)
    if as_json:
        payload = {
            "root": str(report.root),
            "has_index": report.has_index,
            "files": report.file_sizes,
            "tensors": [row.__dict__ for row in report.tensors],
            "total_bytes": report.total_bytes,
            "problems": report.problems,
        }
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
    else:
        sys.stdout.write(format_inspection(report) + "\n")
    return 1 if report.problems else 0
