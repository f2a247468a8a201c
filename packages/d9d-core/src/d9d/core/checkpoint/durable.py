"""Writes that survive a power loss: data and directory entries reach the disk before a completion marker.

A file's bytes are durable after `fsync` of the file; its *name* is durable only after `fsync` of the directory
holding it. A completion marker is therefore written only after every file and every directory of the checkpoint
has been synced, so after a crash the marker never points at data the disk does not have.
"""

from __future__ import annotations

import os
from pathlib import Path

OWNER_ONLY = 0o700


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (names created, renamed, removed) durable."""
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_file(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, deepest first, then `root` itself."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_file(Path(directory) / name)
        fsync_dir(Path(directory))


def write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically and durably (temporary file, fsync, rename, fsync of the directory)."""
    staging = path.with_name(f".{path.name}.tmp")
    with staging.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    staging.replace(path)
    fsync_dir(path.parent)


def make_private_dir(path: Path) -> None:
    """Create `path` (and missing parents) readable by its owner only; an existing one is tightened to that."""
    path.mkdir(parents=True, exist_ok=True, mode=OWNER_ONLY)
    path.chmod(OWNER_ONLY)  # mkdir's mode is filtered by the umask; chmod is exact
