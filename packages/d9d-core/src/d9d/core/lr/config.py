"""LR schedule configuration (pydantic, unknown keys rejected): curves by `type`, phases by `mode`."""

from __future__ import annotations

from typing import Annotated, Literal, assert_never

from pydantic import BaseModel, ConfigDict, Field
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from d9d.core.lr.builder import PiecewiseScheduleBuilder, piecewise_schedule
from d9d.core.lr.curves import CosineCurve, Curve, ExponentialCurve, LinearCurve, PolynomialCurve
from d9d.core.lr.schedule import PiecewiseSchedule

_STRICT = ConfigDict(extra="forbid", frozen=True)


class LinearCurveConfig(BaseModel):
    model_config = _STRICT
    type: Literal["linear"] = "linear"


class CosineCurveConfig(BaseModel):
    model_config = _STRICT
    type: Literal["cosine"] = "cosine"


class PolynomialCurveConfig(BaseModel):
    model_config = _STRICT
    type: Literal["polynomial"] = "polynomial"
    power: float = Field(default=2.0, gt=0)


class ExponentialCurveConfig(BaseModel):
    model_config = _STRICT
    type: Literal["exponential"] = "exponential"


AnyCurveConfig = Annotated[
    LinearCurveConfig | CosineCurveConfig | PolynomialCurveConfig | ExponentialCurveConfig,
    Field(discriminator="type"),
]


def build_curve(config: AnyCurveConfig) -> Curve:
    match config:
        case LinearCurveConfig():
            return LinearCurve()
        case CosineCurveConfig():
            return CosineCurve()
        case PolynomialCurveConfig():
            return PolynomialCurve(config.power)
        case ExponentialCurveConfig():
            return ExponentialCurve()
        case _:
            assert_never(config)


class StepsPhaseConfig(BaseModel):
    """Move to `target` over `steps` steps (a warm-up, typically)."""

    model_config = _STRICT
    mode: Literal["steps"] = "steps"
    steps: int = Field(ge=1)
    target: float
    curve: AnyCurveConfig = Field(default_factory=LinearCurveConfig)


class HoldPhaseConfig(BaseModel):
    """Keep the current multiplier for `steps` steps."""

    model_config = _STRICT
    mode: Literal["hold"] = "hold"
    steps: int = Field(ge=1)


class FractionPhaseConfig(BaseModel):
    """Move to `target` by the step at `until` (a fraction of the total steps)."""

    model_config = _STRICT
    mode: Literal["fraction"] = "fraction"
    until: float = Field(gt=0, le=1)
    target: float
    curve: AnyCurveConfig = Field(default_factory=LinearCurveConfig)


class RestPhaseConfig(BaseModel):
    """Move to `target` by the last step (the final decay); must be the last phase."""

    model_config = _STRICT
    mode: Literal["rest"] = "rest"
    target: float
    curve: AnyCurveConfig = Field(default_factory=LinearCurveConfig)


AnyPhaseConfig = Annotated[
    StepsPhaseConfig | HoldPhaseConfig | FractionPhaseConfig | RestPhaseConfig, Field(discriminator="mode")
]


class PiecewiseScheduleConfig(BaseModel):
    """A learning-rate multiplier that starts at `initial` and follows `phases` in order."""

    model_config = _STRICT
    kind: Literal["piecewise"] = "piecewise"
    initial: float = 0.0
    phases: list[AnyPhaseConfig] = Field(min_length=1)


class ConstantScheduleConfig(BaseModel):
    model_config = _STRICT
    kind: Literal["constant"] = "constant"
    value: float = 1.0


AnyLRScheduleConfig = Annotated[PiecewiseScheduleConfig | ConstantScheduleConfig, Field(discriminator="kind")]


def build_lr_schedule(config: AnyLRScheduleConfig, total_steps: int) -> PiecewiseSchedule:
    """Resolve a schedule for a run of `total_steps` steps.

    Raises:
        ValueError: a phase that does not fit (naming its position, mode and the step it would reach).
    """
    match config:
        case ConstantScheduleConfig():
            return piecewise_schedule(total_steps, initial=config.value).build()
        case PiecewiseScheduleConfig():
            builder = piecewise_schedule(total_steps, initial=config.initial)
            for position, phase in enumerate(config.phases):
                try:
                    builder = _add_phase(builder, phase)
                except ValueError as error:
                    raise ValueError(f"phases[{position}] (mode={phase.mode!r}): {error}") from error
            return builder.build()
        case _:
            assert_never(config)


def _add_phase(builder: PiecewiseScheduleBuilder, phase: AnyPhaseConfig) -> PiecewiseScheduleBuilder:
    match phase:
        case StepsPhaseConfig():
            return builder.for_steps(phase.steps, phase.target, build_curve(phase.curve))
        case HoldPhaseConfig():
            return builder.hold(phase.steps)
        case FractionPhaseConfig():
            return builder.until_fraction(phase.until, phase.target, build_curve(phase.curve))
        case RestPhaseConfig():
            return builder.fill_rest(phase.target, build_curve(phase.curve))
        case _:
            assert_never(phase)


def build_lr_scheduler(config: AnyLRScheduleConfig, optimizer: Optimizer, total_steps: int) -> LambdaLR:
    return build_lr_schedule(config, total_steps).scheduler(optimizer)
