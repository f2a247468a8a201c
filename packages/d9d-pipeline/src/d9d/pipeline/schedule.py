"""`PipelineSchedule`: the core `Trainer`'s `StepSchedule` for a pipelined model.

The Trainer hands over the step's micro-batches and `loss_scale = 1 / global tokens`; the schedule runs the
program of the rank (cached per micro-batch count and mode), then shares the last stage's loss and metric sums
over the pipeline group, so every rank returns the same `ScheduleResult` and the Trainer's data-parallel sums and
logging work unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from d9d.core.loop.schedule import ScheduleResult
from d9d.pipeline.costs import PipelineCosts
from d9d.pipeline.program import Program, StageLayout
from d9d.pipeline.program.builders import build_program, inference
from d9d.pipeline.runtime.action_timing import ActionTimer, gather_stage_costs
from d9d.pipeline.runtime.executor import PipelineExecutor, SplitBackward
from d9d.pipeline.runtime.model_view import merge_stage_modules
from d9d.pipeline.runtime.outcome import StepOutcome
from d9d.pipeline.task import PipelineTask

if TYPE_CHECKING:
    from d9d.pipeline.config import PipelinePlan

logger = logging.getLogger(__name__)
TBatch = TypeVar("TBatch")
ProgramBuilder = Callable[[int], Program]  # micro-batch count -> validated training program


class PipelineSchedule:
    """Runs a rank's stages under a program; satisfies `d9d.core.loop.schedule.StepSchedule`.

    `model` (what the Trainer optimizes, checkpoints and clips) is the merged view of the stages, see
    `merge_stage_modules`; `run` checks it is that view. `cuda_graphs`: replay training steps' compute actions as
    CUDA graphs (`PipelineExecutor`, design note 0028; `PipelineConfig.cuda_graphs`). `plan`: the checked plan the
    programs come from (`build_pipeline_schedule` passes it), which `replan` rebuilds them from under new costs.
    """

    def __init__(
        self,
        *,
        name: str,
        build: ProgramBuilder,
        layout: StageLayout,
        modules: Mapping[int, nn.Module],
        pipeline_rank: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        split_backward: SplitBackward | None = None,
        upstream_group: dist.ProcessGroup | None = None,
        cuda_graphs: bool = False,
        plan: PipelinePlan | None = None,
        measure_costs_at_step: int | None = None,
    ) -> None:
        if measure_costs_at_step is not None and plan is None:
            raise ValueError(
                f"measure_costs_at_step={measure_costs_at_step} needs the PipelinePlan to replan from (plan=None)"
            )
        self.name, self._build, self.layout, self.plan = name, build, layout, plan
        self.measure_costs_at_step = measure_costs_at_step
        self.training_steps = 0  # training steps this schedule ran (measure_costs_at_step counts them)
        self.measured_costs: PipelineCosts | None = None  # what measure_costs_at_step measured, once it has
        self.pipeline_rank, self.group, self.device = pipeline_rank, group, device
        self.executor = PipelineExecutor(
            modules,
            layout,
            pipeline_rank=pipeline_rank,
            group=group,
            upstream_group=upstream_group,
            device=device,
            split_backward=split_backward,
            cuda_graphs=cuda_graphs,
        )
        self.model = merge_stage_modules([modules[stage] for stage in sorted(modules)])
        self._programs: dict[tuple[int, bool], Program] = {}

    def replan(self, costs: PipelineCosts) -> None:
        """Build the training programs again under `costs` (e.g. `PipelineCosts.from_stage_costs` over
        `measure_stage_costs`): the zero-bubble builders reorder their actions; the split and the stages stay. Every
        pipeline rank must call it with the same costs (the builders are deterministic, so the programs agree).
        Needs the plan `build_pipeline_schedule` records."""
        if self.plan is None:
            raise ValueError(
                f"schedule {self.name!r} was built without a PipelinePlan (plan=None); replan needs one: build it "
                "with build_pipeline_schedule, or pass plan= to PipelineSchedule"
            )
        self.plan = dataclasses.replace(self.plan, config=self.plan.config.model_copy(update={"costs": costs}))
        self._build = self.plan.program
        for (_, training), program in self._programs.items():
            if training:  # never runs again: its rank plan and CUDA graphs (a memory pool each) go now
                self.executor.forget(program)
        self._programs = {key: program for key, program in self._programs.items() if not key[1]}

    def program(self, num_microbatches: int, *, training: bool) -> Program:
        """The validated program for `num_microbatches` (built once per count and mode)."""
        key = (num_microbatches, training)
        if key not in self._programs:
            if training:
                self._programs[key] = self._build(num_microbatches)
            else:
                layout = self.layout
                self._programs[key] = build_program(
                    f"{self.name} (forward only)",
                    lambda: inference(layout, num_microbatches),
                    num_microbatches,
                    training=False,
                )
        return self._programs[key]

    def run(
        self,
        model: nn.Module,
        task: Any,
        microbatches: Sequence[Any],
        *,
        loss_scale: float,
        backward: bool,
        timer: ActionTimer | None = None,
    ) -> ScheduleResult:
        """One step (the `StepSchedule` protocol). `timer`: time every compute action into it
        (`measure_stage_costs`); the step at `measure_costs_at_step` makes its own and replans from it."""
        if model is not self.model:
            raise ValueError(
                "the model given to the pipeline schedule is not its stage view; pass `schedule.model` to the Trainer"
            )
        if not isinstance(task, PipelineTask):
            raise TypeError(f"{type(task).__name__} cannot run pipelined: it lacks forward_stage/activation_spec")
        program = self.program(len(microbatches), training=backward)
        if backward:
            self.training_steps += 1
        measuring = backward and self.training_steps == self.measure_costs_at_step
        if measuring and timer is None:
            timer = ActionTimer(self.device)
        outcome = self.executor.run(program, task, microbatches, loss_scale=loss_scale, timer=timer)
        outcome = self._share_last_stage(outcome)
        if measuring:
            assert timer is not None
            self._replan_from(timer)
        return ScheduleResult(
            loss_sum=torch.tensor(outcome.loss_sum, dtype=torch.float64, device=self.device),
            metric_sums=outcome.metric_sums,
        )

    def _replan_from(self, timer: ActionTimer) -> None:
        """The cost model this step's durations imply, and the programs of the following steps planned with it."""
        assert self.plan is not None
        config = self.plan.config
        self.measured_costs = PipelineCosts.from_stage_costs(
            gather_stage_costs(timer, self.layout.num_stages),
            self.plan.num_layers,
            virtual_layers_pre=config.virtual_layers_pre,
            virtual_layers_post=config.virtual_layers_post,
        )
        self.replan(self.measured_costs)
        costs = self.measured_costs
        logger.info(
            "pipeline %s: costs measured at training step %d (layer-forwards), later steps planned with them: "
            "layer %s; head %s; embedding %s",
            self.name,
            self.training_steps,
            costs.layer,
            costs.head,
            costs.embedding,
        )

    def _share_last_stage(self, outcome: StepOutcome) -> StepOutcome:
        if self.group is None or self.layout.pp == 1:
            return outcome
        source = self.layout.rank_of(self.layout.last_stage)
        box: list[Any] = [(outcome.loss_sum, outcome.metric_sums)]
        dist.broadcast_object_list(box, group=self.group, group_src=source, device=self.device)
        loss_sum, metric_sums = box[0]
        return StepOutcome(loss_sum=float(loss_sum), metric_sums=dict(metric_sums))
