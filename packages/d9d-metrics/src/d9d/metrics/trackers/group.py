"""Several trackers behind one: every call goes to each; the run id is the members' ids as a JSON list."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from d9d.metrics.trackers.base import BaseTracker


class TrackerGroup(BaseTracker):
    def __init__(self, trackers: Sequence[BaseTracker]) -> None:
        super().__init__(enabled=any(tracker.enabled for tracker in trackers))
        self.trackers = list(trackers)

    @property
    def run_id(self) -> str:
        return json.dumps([tracker.run_id for tracker in self.trackers])

    def _resume(self, run_id: str, step: int) -> None:
        run_ids = json.loads(run_id)
        if not isinstance(run_ids, list) or len(run_ids) != len(self.trackers):
            raise ValueError(
                f"TrackerGroup.resume: run_id {run_id!r} does not list {len(self.trackers)} member run ids; "
                "was the checkpoint written with another tracker configuration?"
            )
        for tracker, member_id in zip(self.trackers, run_ids, strict=True):
            tracker.resume(member_id, step)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        raise AssertionError("TrackerGroup.log delegates to its members")

    def checkpointed(self, step: int) -> None:
        for tracker in self.trackers:
            tracker.checkpointed(step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
