"""A stage's manifest: what it read, how it was configured, what it wrote. It alone says a stage is complete."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from d9d.flows.jobs.contract.fingerprint import FileFingerprint, digest_json

MANIFEST_FILENAME: Final = "manifest.json"
MANIFEST_VERSION: Final = 1
# The manifest's own checksum: the SHA-256 of its other fields in canonical JSON. A damaged manifest that still
# parses would otherwise pass for a complete output (a flipped digit in a recorded size or key). Manifests written
# before it existed have none and are read as before.
SELF_CHECKSUM_FIELD: Final = "manifest_sha256"
_MANIFEST_FIELDS: Final = frozenset(
    {
        "manifest_version", "stage", "stage_version", "key", "config_hash", "inputs_hash", "created_at", "config",
        "inputs", "outputs", "packages", "statistics",
    }
)  # fmt: skip


class ManifestError(ValueError):
    """A manifest is missing or unreadable (names the file)."""


@dataclass(frozen=True, kw_only=True)
class StageKey:
    """Everything that determines a stage's output; two runs with equal keys produce the same output.

    `config` holds only the settings that change the output (worker counts and retries are left out by the
    stage), `inputs` the checksums of every file the stage reads, `stage_version` the version of the stage's
    code contract (bumped when the same inputs would now give different output).
    """

    stage: str
    stage_version: int
    config: dict[str, Any]
    inputs: tuple[FileFingerprint, ...]

    @property
    def config_hash(self) -> str:
        return digest_json(self.config)

    @property
    def inputs_hash(self) -> str:
        return digest_json([fingerprint.to_json() for fingerprint in self.inputs])

    @property
    def digest(self) -> str:
        return digest_json(
            {
                "stage": self.stage,
                "stage_version": self.stage_version,
                "config": self.config_hash,
                "inputs": self.inputs_hash,
            }
        )


@dataclass(frozen=True, kw_only=True)
class StageManifest:
    stage: str
    stage_version: int
    key: str
    config_hash: str
    inputs_hash: str
    config: dict[str, Any]
    inputs: tuple[FileFingerprint, ...]
    outputs: tuple[FileFingerprint, ...]
    packages: dict[str, str]
    statistics: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""

    @classmethod
    def for_key(
        cls,
        key: StageKey,
        *,
        outputs: tuple[FileFingerprint, ...],
        packages: dict[str, str],
        statistics: dict[str, Any],
        created_at: str,
    ) -> StageManifest:
        return cls(
            stage=key.stage,
            stage_version=key.stage_version,
            key=key.digest,
            config_hash=key.config_hash,
            inputs_hash=key.inputs_hash,
            config=key.config,
            inputs=key.inputs,
            outputs=outputs,
            packages=packages,
            statistics=statistics,
            created_at=created_at,
        )

    def to_json(self) -> dict[str, Any]:
        """The fields, plus the checksum of those fields (`SELF_CHECKSUM_FIELD`)."""
        body = self._body()
        return {**body, SELF_CHECKSUM_FIELD: digest_json(body)}

    def _body(self) -> dict[str, Any]:
        return {
            "manifest_version": MANIFEST_VERSION,
            "stage": self.stage,
            "stage_version": self.stage_version,
            "key": self.key,
            "config_hash": self.config_hash,
            "inputs_hash": self.inputs_hash,
            "created_at": self.created_at,
            "config": self.config,
            "inputs": [fingerprint.to_json() for fingerprint in self.inputs],
            "outputs": [fingerprint.to_json() for fingerprint in self.outputs],
            "packages": self.packages,
            "statistics": self.statistics,
        }

    def write(self, directory: Path) -> Path:
        """Write `manifest.json` into `directory` atomically (a reader sees the old file or the whole new one)."""
        path = directory / MANIFEST_FILENAME
        staging = directory / f".{MANIFEST_FILENAME}.tmp"
        with staging.open("w", encoding="utf-8") as handle:
            json.dump(self.to_json(), handle, indent=2)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        staging.replace(path)
        return path

    @classmethod
    def read(cls, directory: Path) -> StageManifest:
        path = directory / MANIFEST_FILENAME
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as error:
            raise ManifestError(f"{path} does not exist") from error
        except (OSError, ValueError) as error:
            raise ManifestError(f"{path} is unreadable: {error}") from error
        if not isinstance(raw, dict):
            raise ManifestError(f"{path} is malformed: a JSON object was expected, found {type(raw).__name__}")
        unknown = sorted(set(raw) - _MANIFEST_FIELDS - {SELF_CHECKSUM_FIELD})
        if unknown:
            raise ManifestError(f"{path} is damaged: unknown field(s) {', '.join(unknown)}")
        recorded = raw.pop(SELF_CHECKSUM_FIELD, None)
        if recorded is not None and recorded != digest_json(raw):
            raise ManifestError(
                f"{path} is damaged: its content does not match the checksum it records ({SELF_CHECKSUM_FIELD})"
            )
        try:
            if raw["manifest_version"] != MANIFEST_VERSION:
                raise ManifestError(f"{path}: manifest version {raw['manifest_version']}, expected {MANIFEST_VERSION}")
            return cls(
                stage=str(raw["stage"]),
                stage_version=int(raw["stage_version"]),
                key=str(raw["key"]),
                config_hash=str(raw["config_hash"]),
                inputs_hash=str(raw["inputs_hash"]),
                created_at=str(raw.get("created_at", "")),
                config=dict(raw["config"]),
                inputs=tuple(FileFingerprint.from_json(entry) for entry in raw["inputs"]),
                outputs=tuple(FileFingerprint.from_json(entry) for entry in raw["outputs"]),
                packages=dict(raw.get("packages", {})),
                statistics=dict(raw.get("statistics", {})),
            )
        except (KeyError, TypeError, ValueError) as error:
            if isinstance(error, ManifestError):
                raise
            raise ManifestError(f"{path} is malformed: {error!r}") from error
