"""`ActionTimer`: how long each compute action of a step takes on its device, without a profiler.

The executor waits for an action's received inputs before the timer starts, so a duration never includes a wait for
a peer: on CUDA, an event recorded after the stream's waits and one after the action's kernels bracket only its
kernels (the stream is in order); on the CPU, compute is synchronous and the wall clock is the duration. Design
note 0030: these durations are what `PipelineCosts.from_stage_costs` turns into a cost model.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from d9d.pipeline.program import Action, ActionKind, StageCost


class ActionTimer:
    """Collects one duration per compute action it brackets (`start` / `stop`), read with `durations_ms`."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._open: tuple[Action, object] | None = None
        self._marks: list[tuple[Action, object, object]] = []

    def _mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()

    def start(self, action: Action) -> None:
        if self._open is not None:
            raise RuntimeError(f"ActionTimer: {action} started while {self._open[0]} is still running")
        self._open = (action, self._mark())

    def stop(self, action: Action) -> None:
        if self._open is None or self._open[0] != action:
            raise RuntimeError(f"ActionTimer: {action} stopped without being started")
        self._marks.append((action, self._open[1], self._mark()))
        self._open = None

    def durations_ms(self) -> dict[tuple[ActionKind, int], list[float]]:
        """Every duration so far in ms, keyed by (action kind, global stage), in the order the actions ran (on CUDA
        this synchronizes the device once)."""
        if self.cuda:
            torch.cuda.synchronize()
        found: dict[tuple[ActionKind, int], list[float]] = defaultdict(list)
        for action, begin, end in self._marks:
            if isinstance(begin, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
                elapsed = begin.elapsed_time(end)
            else:
                assert isinstance(begin, float)
                assert isinstance(end, float)
                elapsed = (end - begin) * 1e3
            found[(action.kind, action.stage)].append(elapsed)
        return dict(found)

    def medians_ms(self) -> dict[tuple[ActionKind, int], float]:
        """The median duration per (action kind, global stage)."""
        return {key: statistics.median(values) for key, values in self.durations_ms().items()}


def gather_stage_costs(timer: ActionTimer, num_stages: int) -> tuple[StageCost, ...]:
    """Each global stage's median ms per forward, input gradient and weight gradient (a full backward counts as input
    gradient, weight gradient 0), the same on every rank: gathered over the whole job, each the median over the
    ranks that ran the stage (data-parallel replicas too), so programs planned from them agree everywhere, as data
    parallelism's collectives need. Every rank of the job calls it together."""
    local = {(kind.name, stage): ms for (kind, stage), ms in timer.medians_ms().items()}
    gathered: list[object] = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)
    for part in gathered:
        assert isinstance(part, dict)
        for key, ms in part.items():
            samples[key].append(ms)
    merged = {key: statistics.median(values) for key, values in samples.items()}
    costs = []
    for stage in range(num_stages):
        full = merged.get((ActionKind.BACKWARD.name, stage))
        costs.append(
            StageCost(
                forward=merged.get((ActionKind.FORWARD.name, stage), 0.0),
                backward_input=full if full is not None else merged.get((ActionKind.BACKWARD_INPUT.name, stage), 0.0),
                backward_weight=merged.get((ActionKind.BACKWARD_WEIGHT.name, stage), 0.0),
            )
        )
    return tuple(costs)
