"""`d9d verify DIR`: check every stage output and token shard set under DIR against what was recorded.

A stage's manifest records each output file's size and SHA-256; runs compare sizes on every check (cheap), and
this command recomputes the SHA-256s (a full read, so on demand). Token shard sets are opened with their CRC-32s
verified. Exit status: 0 everything matches, 1 something does not (each problem on its own line), 2 nothing
to verify at DIR.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from d9d.core.data import INDEX_FILENAME, TokenShardFormatError, TokenShardSet
from d9d.flows.jobs.contract.fingerprint import sha256_file
from d9d.flows.jobs.contract.manifest import MANIFEST_FILENAME, ManifestError, StageManifest

EXIT_MISMATCH = 1
EXIT_NOTHING = 2


@dataclass
class VerifyReport:
    checked: list[str] = field(default_factory=list)  # one line per verified item
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_tree(root: Path) -> VerifyReport:
    """Verify every stage output (manifest.json) and every token shard set (index.json) under `root`."""
    report = VerifyReport()
    for manifest_path in sorted(root.rglob(MANIFEST_FILENAME)):
        _verify_stage(manifest_path.parent, report)
    for index_path in sorted(root.rglob(INDEX_FILENAME)):
        try:
            shards = TokenShardSet(index_path.parent)
        except TokenShardFormatError as error:
            report.problems.append(str(error))
            continue
        report.checked.append(f"{index_path.parent}: {len(shards.shards)} token shards, checksums match")
    return report


def _verify_stage(directory: Path, report: VerifyReport) -> None:
    try:
        manifest = StageManifest.read(directory)
    except ManifestError as error:
        report.problems.append(f"{directory}: {error}")
        return
    bad = 0
    for output in manifest.outputs:
        path = directory / output.name
        if not path.is_file():
            problem = "is missing"
        elif (size := path.stat().st_size) != output.size:
            problem = f"has {size} bytes, the manifest records {output.size}"
        elif (digest := sha256_file(path)) != output.sha256:
            problem = f"sha256 {digest[:16]}... differs from the manifest's {output.sha256[:16]}... (same size)"
        else:
            continue
        bad += 1
        report.problems.append(f"{path} {problem}; rerun the {manifest.stage} stage to rebuild its output")
    if not bad:
        report.checked.append(f"{directory}: {manifest.stage} output, {len(manifest.outputs)} files match sha256")


def add_verify_command(commands: Any) -> None:
    """Register `verify` on the `d9d` command line's subparsers."""
    verify = commands.add_parser(
        "verify",
        help="check stage outputs (sizes, SHA-256) and token shards (CRC-32) under a directory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument("directory", type=Path, metavar="DIR", help="a work directory, a stage output or a shard set")


def run_verify_command(args: argparse.Namespace) -> int:
    root: Path = args.directory
    if not root.is_dir():
        sys.stderr.write(f"d9d: error: {root} is not a directory\n")
        return EXIT_NOTHING
    report = verify_tree(root)
    for line in report.checked:
        sys.stdout.write(f"ok   {line}\n")
    for line in report.problems:
        sys.stdout.write(f"BAD  {line}\n")
    if not report.checked and not report.problems:
        sys.stderr.write(f"d9d: error: nothing to verify under {root}: no {MANIFEST_FILENAME} and no token shard set\n")
        return EXIT_NOTHING
    return 0 if report.ok else EXIT_MISMATCH
