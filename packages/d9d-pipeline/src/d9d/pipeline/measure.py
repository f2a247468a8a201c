"""`measure_stage_costs`: what every stage's forward, input gradient and weight gradient take, measured in a real
training step of the schedule, for a cost model (`PipelineCosts.from_stage_costs`, design note 0030)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from d9d.core.loop.schedule import ScheduleResult
from d9d.pipeline.program import StageCost
from d9d.pipeline.runtime.action_timing import ActionTimer, gather_stage_costs
from d9d.pipeline.schedule import PipelineSchedule


def measure_stage_costs(
    schedule: PipelineSchedule, task: Any, batches: Sequence[Any], *, loss_scale: float
) -> tuple[tuple[StageCost, ...], ScheduleResult]:
    """Run one training step of `schedule` over `batches` with every compute action timed; return each global
    stage's median ms per micro-batch (forward, input gradient, weight gradient; a full backward counts as input
    gradient, with weight gradient 0), and the step's result. Every rank of the job gets the same costs (each is
    the median over the ranks that ran that stage, e.g. over data-parallel replicas), so programs planned from them
    agree everywhere, as the collectives of data parallelism need.

    It is a real step: gradients accumulate as in any step (take it as a step, or zero them after). It runs the
    interpreter even where CUDA graphs are on, and a duration never includes a wait for a peer (see
    `runtime/action_timing.py`). Call it on every rank of the job together, after a warm-up step: a first step also
    times allocator growth, compilation and communicator set-up.
    """
    timer = ActionTimer(schedule.device)
    result = schedule.run(schedule.model, task, batches, loss_scale=loss_scale, backward=True, timer=timer)
    return gather_stage_costs(timer, schedule.layout.num_stages), result
