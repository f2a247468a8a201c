"""Log metrics through a tracker from the Trainer's events, synchronised without stalling training.

When step N finishes, the reduction of the metrics' states starts (`start_sync`, asynchronous) and the local states
reset; its results are fetched when step N+1 finishes, so the all-reduce overlaps a whole step. Before a checkpoint
the pending results are fetched and logged (so a tracker that commits history at checkpoints has them), and at the
end of training. Every rank must attach a logger over the same metrics; only the tracker's main process writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from d9d.core.loop import CheckpointStarted, EventBus, StepFinished, Tracker, TrainingFinished
from d9d.metrics.metric import Metric
from d9d.metrics.sync import MetricSync, start_sync


class MetricLogger:
    def __init__(
        self,
        metrics: Mapping[str, Metric[Any]],
        tracker: Tracker | None,
        *,
        group: dist.ProcessGroup | None = None,
        every: int = 1,
        prefix: str = "",
    ) -> None:
        if every < 1:
            raise ValueError(f"MetricLogger: every must be >= 1, got {every}")
        self.metrics = dict(metrics)
        self._tracker = tracker
        self._group = group
        self._every = every
        self._prefix = prefix
        self._pending: tuple[int, MetricSync] | None = None
        self.logged: dict[int, dict[str, Any]] = {}  # step -> every synced result (scalars and the rest)

    def attach(self, events: EventBus) -> None:
        events.subscribe(StepFinished, lambda event: self.step_finished(event.step))
        events.subscribe(CheckpointStarted, lambda event: self._flush_quietly())
        events.subscribe(TrainingFinished, lambda event: self._flush_quietly())

    def _flush_quietly(self) -> None:
        self.flush()

    def step_finished(self, step: int) -> None:
        self.flush()
        if step % self._every == 0:
            self._pending = (step, start_sync(self.metrics, self._group))
            for metric in self.metrics.values():  # the sync reduces copies: the states may reset at once
                metric.reset()

    def flush(self) -> dict[str, Any] | None:
        """Wait for the pending synchronisation, log its scalar results and return them all (None: none pending)."""
        if self._pending is None:
            return None
        step, pending = self._pending
        self._pending = None
        results = pending.results()
        self.logged[step] = results
        scalars = {
            f"{self._prefix}{name}": float(value)
            for name, value in results.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
        if self._tracker is not None and scalars:
            self._tracker.log(step, scalars)
        return results
