"""`PipelineConfig` (which schedule, how layers are split) and the checks that run before any rank starts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Literal, assert_never

from pydantic import BaseModel, ConfigDict, Field

from d9d.pipeline.costs import PipelineCosts
from d9d.pipeline.program import Placement, Program, StageCost, StageLayout
from d9d.pipeline.program.builders import (
    ComputeOrder,
    build_program,
    dual_pipe_v,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    zero_bubble_h1,
    zero_bubble_v,
)
from d9d.pipeline.stage import PipelineStage


class _Schedule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GPipeConfig(_Schedule):
    kind: Literal["gpipe"] = "gpipe"


class OneFOneBConfig(_Schedule):
    kind: Literal["1f1b"] = "1f1b"


class Interleaved1F1BConfig(_Schedule):
    kind: Literal["interleaved_1f1b"] = "interleaved_1f1b"
    stages_per_rank: int = Field(default=2, ge=2, description="virtual stages per rank (looped placement)")


_ACTIVATION_MEMORY = (
    "activation memory a rank may hold, as a multiple of 1F1B's (forwards awaiting their weight gradient): 1.0 as "
    "published; more lets the order run further ahead where weight gradients are too cheap to fill the bubbles "
    "(2.0 is ZB-2p's trade; design note 0030)"
)


class ZeroBubbleH1Config(_Schedule):
    kind: Literal["zb_h1"] = "zb_h1"
    activation_memory: float = Field(default=1.0, ge=1.0, le=64.0, allow_inf_nan=False, description=_ACTIVATION_MEMORY)


class ZeroBubbleVConfig(_Schedule):
    kind: Literal["zbv"] = "zbv"
    activation_memory: float = Field(default=1.0, ge=1.0, le=64.0, allow_inf_nan=False, description=_ACTIVATION_MEMORY)


class DualPipeVConfig(_Schedule):
    kind: Literal["dualpipe_v"] = "dualpipe_v"


AnyScheduleConfig = Annotated[
    GPipeConfig | OneFOneBConfig | Interleaved1F1BConfig | ZeroBubbleH1Config | ZeroBubbleVConfig | DualPipeVConfig,
    Field(discriminator="kind"),
]


class PipelineConfig(BaseModel):
    """Pipeline parallelism of a job (its degree is the mesh's `pp`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schedule: AnyScheduleConfig = Field(default_factory=OneFOneBConfig)
    virtual_layers_pre: int = Field(default=0, ge=0, description="layer slots the embedding counts for (stage 0)")
    virtual_layers_post: int = Field(default=0, ge=0, description="layer slots the head counts for (last stage)")
    even_split: bool = Field(default=False, description="refuse a layer count the stages cannot share equally")
    costs: PipelineCosts | None = Field(
        default=None,
        description="what layers, embedding and head cost; the zero-bubble builders (zb_h1, zbv) plan with it "
        "(None: uniform costs, as before)",
    )
    cuda_graphs: bool = Field(
        default=False,
        description="replay each training step's compute actions as CUDA graphs after a warm-up and a capture step "
        "(design note 0028); what cannot be captured (CPU, FSDP stages, MoE layers) runs eagerly with a logged reason",
    )
    measure_costs_at_step: int | None = Field(
        default=None,
        ge=1,
        description="time every compute action of this training step of the process (1-based; 2 or later, after a "
        "warm-up) and plan the following steps under the cost model the durations imply, replacing `costs` "
        "(zb_h1, zbv; design note 0030). None: plan with `costs` throughout",
    )


def _builder(
    config: AnyScheduleConfig, pp: int, stage_costs: tuple[StageCost, ...] | None = None
) -> Callable[[int], tuple[StageLayout, ComputeOrder]]:
    """The compute-order builder of `config`; `stage_costs` (one per global stage) reach the greedy zero-bubble
    builders; the other schedules have a fixed order."""
    match config:
        case GPipeConfig():
            return partial(gpipe, pp)
        case OneFOneBConfig():
            return partial(one_f_one_b, pp)
        case Interleaved1F1BConfig():
            stages = config.stages_per_rank
            return lambda m: interleaved_one_f_one_b(pp, m, stages)
        case ZeroBubbleH1Config():
            memory = config.activation_memory
            return lambda m: zero_bubble_h1(pp, m, stage_costs, activation_memory=memory)
        case ZeroBubbleVConfig():
            memory = config.activation_memory
            return lambda m: zero_bubble_v(pp, m, stage_costs, activation_memory=memory)
        case DualPipeVConfig():
            return partial(dual_pipe_v, pp)
        case _:
            assert_never(config)


def stages_per_rank(config: AnyScheduleConfig) -> int:
    match config:
        case Interleaved1F1BConfig():
            return config.stages_per_rank
        case ZeroBubbleVConfig() | DualPipeVConfig():
            return 2
        case GPipeConfig() | OneFOneBConfig() | ZeroBubbleH1Config():
            return 1
        case _:
            assert_never(config)


@dataclass(frozen=True)
class PipelinePlan:
    """A checked pipeline: the layout, each rank's stages and the validated program per micro-batch count."""

    config: PipelineConfig
    layout: StageLayout
    num_layers: int

    def stage(self, index: int) -> PipelineStage:
        return PipelineStage(
            index,
            self.layout.num_stages,
            virtual_layers_pre=self.config.virtual_layers_pre,
            virtual_layers_post=self.config.virtual_layers_post,
        )

    def stages_of(self, pipeline_rank: int) -> list[PipelineStage]:
        return [self.stage(index) for index in self.layout.stages_of(pipeline_rank)]

    def stage_costs(self) -> tuple[StageCost, ...] | None:
        """Each global stage's cost under `config.costs` (None without a cost model)."""
        if self.config.costs is None:
            return None
        return self.config.costs.stage_costs(
            self.layout.num_stages,
            self.num_layers,
            virtual_layers_pre=self.config.virtual_layers_pre,
            virtual_layers_post=self.config.virtual_layers_post,
        )

    def program(self, num_microbatches: int) -> Program:
        check_microbatches(self.config.schedule, self.layout.pp, num_microbatches)
        builder = _builder(self.config.schedule, self.layout.pp, self.stage_costs())
        return build_program(self.config.schedule.kind, lambda: builder(num_microbatches), num_microbatches)


def check_microbatches(schedule: AnyScheduleConfig, pp: int, num_microbatches: int) -> None:
    """Raise `ValueError` naming the values when `schedule` cannot run `num_microbatches` on `pp` ranks."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches}: a step needs at least one micro-batch")
    match schedule:
        case Interleaved1F1BConfig() if num_microbatches % pp:
            raise ValueError(
                f"schedule interleaved_1f1b needs the micro-batches per step to be a multiple of pp, got "
                f"num_microbatches={num_microbatches} with pp={pp}; use {pp * max(1, round(num_microbatches / pp))}"
            )
        case DualPipeVConfig() if num_microbatches < 2 * pp:
            raise ValueError(
                f"schedule dualpipe_v needs at least 2*pp={2 * pp} micro-batches per step, got "
                f"num_microbatches={num_microbatches} with pp={pp}"
            )
        case _:
            return


def plan_pipeline(
    config: PipelineConfig, *, pp: int, num_layers: int, num_microbatches: int, dp_shard: int = 1, tp: int = 1
) -> PipelinePlan:
    """Check a pipeline before any rank starts (a launcher calls this); raises `ValueError` naming the values.

    Checks: micro-batches per step that the schedule can run, and a layer count every stage can get a share of
    (equal shares when `even_split`). Every schedule, the split-backward ones included, composes with FSDP
    (`dp_shard`), tensor parallelism (`tp`) and context parallelism, each covered by a parity test
    (docs/pipeline.md, design note 0016); `dp_shard` and `tp` are only checked to be degrees.
    """
    for name, value in (("pp", pp), ("dp_shard", dp_shard), ("tp", tp)):
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    layout_stages = stages_per_rank(config.schedule)
    kind = config.schedule.kind
    layout = StageLayout(pp, layout_stages, _placement(kind))
    slots = config.virtual_layers_pre + num_layers + config.virtual_layers_post
    if slots < layout.num_stages:
        raise ValueError(
            f"num_layers={num_layers} (+{slots - num_layers} virtual) cannot fill {layout.num_stages} stages "
            f"(pp={pp} x {layout_stages} stages per rank for {kind}); use fewer stages or more layers"
        )
    if config.even_split and slots % layout.num_stages:
        raise ValueError(
            f"num_layers={num_layers} with virtual_layers_pre={config.virtual_layers_pre} and "
            f"virtual_layers_post={config.virtual_layers_post} gives {slots} layer slots, not divisible by "
            f"{layout.num_stages} stages (pp={pp} x {layout_stages} for {kind}); even_split asks for equal shares"
        )
    plan = PipelinePlan(config=config, layout=layout, num_layers=num_layers)
    if config.measure_costs_at_step is not None:
        check_measurable(plan)
    plan.program(num_microbatches)  # builds and validates: any schedule bug fails here, before ranks start
    return plan


def check_measurable(plan: PipelinePlan) -> None:
    """Raise `ValueError` naming the values when `measure_costs_at_step` cannot work for `plan`: the schedule must
    plan with costs, and a cost model needs a stage holding layers and neither the embedding nor the head."""
    config, kind = plan.config, plan.config.schedule.kind
    if kind not in ("zb_h1", "zbv"):
        raise ValueError(
            f"measure_costs_at_step={config.measure_costs_at_step} with schedule {kind!r}: only the schedules that "
            "plan with costs (zb_h1, zbv) can use what is measured; unset it or pick one of them"
        )
    stages = [plan.stage(index) for index in range(plan.layout.num_stages)]
    if not any(s.layers(plan.num_layers) and not s.is_first and not s.is_last for s in stages):
        raise ValueError(
            f"measure_costs_at_step={config.measure_costs_at_step}: {len(stages)} stages (pp={plan.layout.pp}, "
            f"{kind}) with virtual_layers_pre={config.virtual_layers_pre} and virtual_layers_post="
            f"{config.virtual_layers_post} leave no stage with layers and neither the embedding nor the head, which a "
            "cost model measures a layer on; use zbv, pp of at least 3, or fewer virtual layers"
        )


def _placement(kind: str) -> Placement:
    return Placement.V if kind in ("zbv", "dualpipe_v") else Placement.LOOP
