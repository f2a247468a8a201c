"""The stage contract: stages exchange paths and manifests; a manifest, not an orchestrator's cache, says done."""

from d9d.flows.jobs.contract.commit import StageReporter
from d9d.flows.jobs.contract.fingerprint import FileFingerprint, digest_json, package_versions, sha256_file
from d9d.flows.jobs.contract.manifest import MANIFEST_FILENAME, ManifestError, StageKey, StageManifest
from d9d.flows.jobs.contract.result import StageResult, StageStatus
from d9d.flows.jobs.contract.stage_directory import (
    Completeness,
    PartialStage,
    Piece,
    StageBusyError,
    StageDirectory,
    StageOutputConflict,
    Status,
)

__all__ = [
    "MANIFEST_FILENAME",
    "Completeness",
    "FileFingerprint",
    "ManifestError",
    "PartialStage",
    "Piece",
    "StageBusyError",
    "StageDirectory",
    "StageKey",
    "StageManifest",
    "StageOutputConflict",
    "StageReporter",
    "StageResult",
    "StageStatus",
    "Status",
    "digest_json",
    "package_versions",
    "sha256_file",
]
