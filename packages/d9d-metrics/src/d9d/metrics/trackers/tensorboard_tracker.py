"""TensorBoard event files under `<directory>/<run_id>/`. A resumed writer opens with `purge_step=step + 1`: it
writes a session-start event that makes TensorBoard's readers drop the dead attempt's events after `step`. Needs
the `tensorboard` extra."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from d9d.metrics.trackers.base import BaseTracker, new_run_id, require_backend

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


class TensorBoardTracker(BaseTracker):
    def __init__(
        self,
        directory: Path,
        *,
        enabled: bool = True,
        run_id: str | None = None,
        hparams: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(enabled=enabled, hparams=hparams)
        if enabled:
            require_backend("tensorboard", "tensorboard")
        self._directory = directory
        self._run_id = run_id or new_run_id()
        self._writer: SummaryWriter | None = None

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def log_dir(self) -> Path:
        return self._directory / self._run_id

    def _resume(self, run_id: str, step: int) -> None:
        self._run_id = run_id

    def _open(self) -> SummaryWriter:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # the optional backend, imported only when used

            purge_step = None if self._resumed_step is None else self._resumed_step + 1
            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)
            if self.hparams and purge_step is None:
                table = "\n".join(f"| {key} | {value} |" for key, value in sorted(self.hparams.items()))
                self._writer.add_text("hparams", f"| name | value |\n|---|---|\n{table}", global_step=0)
        return self._writer

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        writer = self._open()
        for name, value in metrics.items():
            writer.add_scalar(name, value, global_step=step)

    def _checkpointed(self, step: int) -> None:
        self._open().flush()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
