"""An aim run in a local repository. The run hash is the run id; a resumed job reattaches with
`Run(run_hash, force_resume=True)` (the dead attempt still holds the run's lock) and tracks the replayed steps again,
which overwrites them: aim keys a metric's values by step. Needs the `aim` extra.

System-parameter logging, terminal capture and resource tracking are off: the first needs `pkg_resources`, which
setuptools 82 removed (aim#2858), and the other two start threads in the training process.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from d9d.metrics.trackers.base import BaseTracker, require_backend

if TYPE_CHECKING:
    from aim.sdk.run import Run


class AimTracker(BaseTracker):
    def __init__(
        self,
        repo: Path,
        *,
        experiment: str = "d9d",
        name: str | None = None,
        enabled: bool = True,
        hparams: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(enabled=enabled, hparams=hparams)
        if enabled:
            require_backend("aim", "aim")
        self._repo = repo
        self._experiment = experiment
        self._name = name
        self._run_hash: str | None = None
        self._run: Run | None = None

    @property
    def run_id(self) -> str:
        if not self.enabled:
            return self._run_hash or ""
        return str(self._open().hash)

    def _resume(self, run_id: str, step: int) -> None:
        if self._run is not None and self._run.hash != run_id:
            raise RuntimeError(f"AimTracker.resume({run_id!r}): run {self._run.hash} is already open")
        self._run_hash = run_id

    def _open(self) -> Run:
        if self._run is None:
            from aim.sdk.repo import Repo  # the optional backend, imported only when used
            from aim.sdk.run import Run

            Repo.from_path(str(self._repo), init=True)
            resuming = self._run_hash is not None
            self._run = Run(
                run_hash=self._run_hash,
                repo=str(self._repo),
                experiment=self._experiment,
                force_resume=resuming,
                system_tracking_interval=None,
                log_system_params=False,
                capture_terminal_logs=False,
            )
            if self._name is not None:
                self._run.name = self._name
            if not resuming:
                self._run["hparams"] = self.hparams
            self._run_hash = self._run.hash
        return self._run

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        run = self._open()
        for name, value in metrics.items():
            run.track(value, name=name, step=step)

    def _close(self) -> None:
        if self._run is not None:
            run: Any = self._run  # aim's `close` has no annotations
            run.close()
            self._run = None
