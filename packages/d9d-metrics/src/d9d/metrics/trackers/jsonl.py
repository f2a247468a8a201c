"""A plain local tracker: `<directory>/<run_id>.jsonl`, one JSON object per `log` call (`{"step": ..., ...}`), and
`<run_id>.hparams.json`. On resume the file is rewritten without the records after the checkpoint's step (atomically:
a temporary file renamed over it), so each step appears once however often the job was killed."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from d9d.metrics.trackers.base import BaseTracker, new_run_id


class JsonlTracker(BaseTracker):
    def __init__(
        self,
        directory: Path,
        *,
        enabled: bool = True,
        run_id: str | None = None,
        hparams: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(enabled=enabled, hparams=hparams)
        self._directory = directory
        self._run_id = run_id or new_run_id()
        self._started = False

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def path(self) -> Path:
        return self._directory / f"{self._run_id}.jsonl"

    def _resume(self, run_id: str, step: int) -> None:
        self._run_id = run_id
        if not self.enabled or not self.path.exists():
            return
        kept = [line for line in self.path.read_text(encoding="utf-8").splitlines() if _step_of(line) <= step]
        temporary = self.path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        temporary.replace(self.path)

    def _start(self) -> None:
        self._directory.mkdir(parents=True, exist_ok=True)
        hparams_path = self._directory / f"{self._run_id}.hparams.json"
        if self.hparams and not hparams_path.exists():
            hparams_path.write_text(json.dumps(self.hparams, indent=1, sort_keys=True), encoding="utf-8")
        self._started = True

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if not self._started:
            self._start()
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, **metrics}) + "\n")

    def _checkpointed(self, step: int) -> None:
        if self.path.exists():
            with self.path.open("a", encoding="utf-8") as handle:
                os.fsync(handle.fileno())


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        # A line torn by the kill (half written) has no step: drop it, the step is logged again.
        return 2**63
