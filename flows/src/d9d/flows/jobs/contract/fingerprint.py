"""Content fingerprints: file checksums, canonical JSON digests and the versions of the packages that ran."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

_CHUNK_BYTES = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def digest_json(value: Any) -> str:
    """sha256 of `value` as canonical JSON (sorted keys, no whitespace): equal data gives an equal digest."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True, kw_only=True)
class FileFingerprint:
    """A file by name, size and sha256; `name` is relative to whatever directory the record is about."""

    name: str
    size: int
    sha256: str

    @classmethod
    def of(cls, path: Path, *, name: str | None = None) -> FileFingerprint:
        return cls(name=name if name is not None else str(path), size=path.stat().st_size, sha256=sha256_file(path))

    @classmethod
    def of_tree(cls, root: Path, *, prefix: str = "", hidden: bool = True) -> list[FileFingerprint]:
        """Every file below `root` in path order, named `prefix` + its path under `root` (`hidden=False` leaves out
        dot files, e.g. a conversion's record of what it wrote)."""
        return [
            cls.of(path, name=f"{prefix}{path.relative_to(root)}")
            for path in sorted(root.rglob("*"))
            if path.is_file() and (hidden or not path.name.startswith("."))
        ]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> FileFingerprint:
        return cls(name=str(raw["name"]), size=int(raw["size"]), sha256=str(raw["sha256"]))


def package_versions(distributions: Iterable[str]) -> dict[str, str]:
    """Installed versions of `distributions` ("absent" where one is not installed)."""
    versions = {}
    for name in distributions:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions
