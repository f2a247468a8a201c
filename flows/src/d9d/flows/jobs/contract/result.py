"""What a stage reports when it returns: ran or skipped, why, and where each of its outputs is."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

StageStatus = Literal["ran", "skipped"]


@dataclass(frozen=True, kw_only=True)
class StageResult:
    stage: str
    status: StageStatus
    reason: str
    output: str
    manifest: str
    artifacts: dict[str, str] = field(default_factory=dict)  # label -> path, for the final summary
    statistics: dict[str, Any] = field(default_factory=dict)

    def with_reason(self, reason: str) -> StageResult:
        """This result giving `reason` (a flow reports why the stage ran: its manifest check, not the commit)."""
        return replace(self, reason=reason)

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "status": self.status,
            "reason": self.reason,
            "output": self.output,
            "manifest": self.manifest,
            "artifacts": dict(self.artifacts),
            "statistics": dict(self.statistics),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> StageResult:
        return cls(
            stage=str(raw["stage"]),
            status=raw["status"],
            reason=str(raw["reason"]),
            output=str(raw["output"]),
            manifest=str(raw["manifest"]),
            artifacts=dict(raw.get("artifacts", {})),
            statistics=dict(raw.get("statistics", {})),
        )
