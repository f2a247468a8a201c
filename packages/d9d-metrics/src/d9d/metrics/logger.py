"""Log metrics through a tracker from the Trainer's events, synchronised without stalling training.

When step N finishes (every `every` steps), the reduction of the metrics' states starts (`start_sync`,
asynchronous) and the local states reset; its results are fetched when the next step finishes, so the all-reduce
overlaps a whole step. Before a checkpoint and at the end of training the pending results are fetched and logged,
and the steps since the last started sync (`every` > 1) are synced and logged at once at the current step: nothing
updated is lost, and a tracker that commits history at checkpoints has every row. Every rank must attach a logger
over the same metrics and the same `group` (the data-parallel group: ranks that hold different data); only the
tracker's main process writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from d9d.core.loop import CheckpointStarted, EventBus, StepFinished, Tracker, TrainingFinished
from d9d.metrics.metric import Metric
from d9d.metrics.sync import MetricSync, start_sync


class MetricLogger:
    """`group`: the process group to reduce over, normally the data-parallel one (`dp_group(ctx)` from
    `d9d.core.loop.reduce`); None is the whole world, right only when every rank holds different data.
    `keep_results`: how many of the latest synced results `logged` keeps (0: none)."""

    def __init__(
        self,
        metrics: Mapping[str, Metric[Any]],
        tracker: Tracker | None,
        *,
        group: dist.ProcessGroup | None = None,
        every: int = 1,
        prefix: str = "",
        keep_results: int = 8,
    ) -> None:
        if every < 1:
            raise ValueError(f"MetricLogger: every must be >= 1, got {every}")
        if keep_results < 0:
            raise ValueError(f"MetricLogger: keep_results must be >= 0, got {keep_results}")
        self.metrics = dict(metrics)
        self._tracker = tracker
        self._group = group
        self._every = every
        self._prefix = prefix
        self._keep_results = keep_results
        self._pending: tuple[int, MetricSync] | None = None
        # Steps, identical on every rank (so every rank starts the same collectives): the last finished, the last
        # whose states a sync took.
        self._last_step = 0
        self._synced_step = 0
        self.logged: dict[int, dict[str, Any]] = {}  # step -> synced results (scalars and the rest), the latest few

    def attach(self, events: EventBus) -> None:
        events.subscribe(StepFinished, lambda event: self.step_finished(event.step))
        events.subscribe(CheckpointStarted, lambda event: self.sync_now(event.step))
        events.subscribe(TrainingFinished, lambda event: self.sync_now(event.step))

    def step_finished(self, step: int) -> None:
        self.flush()
        self._last_step = step
        if step % self._every == 0:
            self._start(step)

    def sync_now(self, step: int) -> None:
        """Log the pending results and, if steps finished since the last started sync, sync and log them at `step`
        (before a checkpoint, at the end). Every rank calls it at the same point."""
        self.flush()
        if self._last_step > self._synced_step:
            self._start(step)
            self.flush()

    def _start(self, step: int) -> None:
        self._pending = (step, start_sync(self.metrics, self._group))
        self._synced_step = self._last_step
        for metric in self.metrics.values():  # the sync reduces copies: the states may reset at once
            metric.reset()

    def flush(self) -> dict[str, Any] | None:
        """Wait for the pending synchronisation, log its scalar results and return them all (None: none pending)."""
        if self._pending is None:
            return None
        step, pending = self._pending
        self._pending = None
        results = pending.results()
        if self._keep_results:
            self.logged[step] = results
            while len(self.logged) > self._keep_results:
                del self.logged[next(iter(self.logged))]  # the oldest
        scalars = {
            f"{self._prefix}{name}": float(value)
            for name, value in results.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
        if self._tracker is not None and scalars:
            self._tracker.log(step, scalars)
        return results
