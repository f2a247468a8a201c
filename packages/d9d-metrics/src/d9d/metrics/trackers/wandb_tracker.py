"""A Weights & Biases run (offline, online or disabled) with a run id we choose, so a resumed job passes the same
`id` with `resume="allow"`.

Offline, wandb writes one new `offline-run-*` directory per process and never rewrites it, so a step logged by an
attempt that is then killed could not be taken back. Records are therefore held in memory and handed to wandb only
when the checkpoint covering their step is complete (`checkpointed`), or at `close`: a step after the last
checkpoint is logged only by the attempt that survives it. The same buffering keeps online runs consistent too.
Needs the `wandb` extra.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from d9d.metrics.trackers.base import BaseTracker, new_run_id, require_backend

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

WandbMode = Literal["offline", "online", "disabled"]


class WandbTracker(BaseTracker):
    def __init__(
        self,
        directory: Path,
        *,
        project: str = "d9d",
        group: str | None = None,
        name: str | None = None,
        entity: str | None = None,
        mode: WandbMode = "offline",
        flush_interval_s: float = 0.1,
        enabled: bool = True,
        run_id: str | None = None,
        hparams: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(enabled=enabled, hparams=hparams)
        if enabled:
            require_backend("wandb", "wandb")
        self._directory = directory
        self._project, self._group, self._name, self._entity, self._mode = project, group, name, entity, mode
        self._flush_interval_s = flush_interval_s
        self._run_id = run_id or new_run_id()
        self._pending: list[tuple[int, dict[str, float]]] = []
        self._run: Run | None = None

    @property
    def run_id(self) -> str:
        return self._run_id

    def _resume(self, run_id: str, step: int) -> None:
        if self._run is not None:
            raise RuntimeError(f"WandbTracker.resume({run_id!r}): run {self._run_id} is already open")
        self._run_id = run_id
        self._pending = [(logged, metrics) for logged, metrics in self._pending if logged <= step]

    def _open(self) -> Run:
        if self._run is None:
            import wandb  # the optional backend, imported only when used

            self._directory.mkdir(parents=True, exist_ok=True)
            settings = wandb.Settings(
                console="off",
                x_disable_stats=True,
                disable_git=True,
                save_code=False,
                silent=True,
                # Written to the `.wandb` file this often: records handed over at a checkpoint must survive a kill.
                x_transaction_log_flush_interval=self._flush_interval_s,
            )
            self._run = wandb.init(
                dir=str(self._directory),
                project=self._project,
                group=self._group,
                name=self._name,
                entity=self._entity,
                id=self._run_id,
                resume="allow",
                mode=self._mode,
                config=self.hparams,
                settings=settings,
            )
        return self._run

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        self._pending.append((step, metrics))

    def _hand_over(self, up_to: int | None) -> None:
        due = [(step, metrics) for step, metrics in self._pending if up_to is None or step <= up_to]
        self._pending = [(step, metrics) for step, metrics in self._pending if up_to is not None and step > up_to]
        if not due:
            return
        run = self._open()
        merged: dict[int, dict[str, float]] = {}
        for step, metrics in due:  # training and validation metrics of one step go in as one history row
            merged.setdefault(step, {}).update(metrics)
        for step in sorted(merged):
            run.log(merged[step], step=step, commit=True)  # finish the row now, not when the next step comes

    def _checkpointed(self, step: int) -> None:
        self._hand_over(step)
        if self._run is not None and self._mode == "offline":
            # Let wandb-core write them before training goes on: a round trip through its (ordered) request queue
            # where this wandb version offers one, then one flush interval of the `.wandb` file.
            interface = getattr(self._run, "_interface", None)
            if interface is not None:
                interface.deliver_get_summary().wait_or(timeout=30)
            time.sleep(2 * self._flush_interval_s)

    def _close(self) -> None:
        self._hand_over(None)
        if self._run is not None:
            self._run.finish()
            self._run = None
