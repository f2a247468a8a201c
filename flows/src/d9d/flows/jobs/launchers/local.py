"""The `local` launcher: `torchrun` on this machine (`d9d.flows.jobs.launch`), exactly as before launchers existed."""

from __future__ import annotations

from dataclasses import dataclass

from d9d.flows.jobs.launch import LaunchSpec, launch
from d9d.flows.jobs.launchers.base import LineCallback, ProgressCallback


@dataclass(frozen=True)
class LocalLauncher:
    def run(
        self,
        spec: LaunchSpec,
        *,
        on_progress: ProgressCallback | None = None,
        on_line: LineCallback | None = None,
        note: LineCallback | None = None,
    ) -> None:
        del note
        launch(spec, on_progress=on_progress, on_line=on_line)
