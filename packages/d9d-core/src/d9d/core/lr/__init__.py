"""Learning-rate schedules: a composable piecewise builder, its configuration, and a PNG plot."""

from d9d.core.lr.builder import PiecewiseScheduleBuilder, piecewise_schedule
from d9d.core.lr.config import (
    AnyCurveConfig,
    AnyLRScheduleConfig,
    AnyPhaseConfig,
    ConstantScheduleConfig,
    CosineCurveConfig,
    ExponentialCurveConfig,
    FractionPhaseConfig,
    HoldPhaseConfig,
    LinearCurveConfig,
    PiecewiseScheduleConfig,
    PolynomialCurveConfig,
    RestPhaseConfig,
    StepsPhaseConfig,
    build_curve,
    build_lr_schedule,
    build_lr_scheduler,
)
from d9d.core.lr.curves import CosineCurve, Curve, ExponentialCurve, LinearCurve, PolynomialCurve
from d9d.core.lr.plot import plot_schedule
from d9d.core.lr.schedule import Phase, PiecewiseSchedule

__all__ = [
    "AnyCurveConfig",
    "AnyLRScheduleConfig",
    "AnyPhaseConfig",
    "ConstantScheduleConfig",
    "CosineCurve",
    "CosineCurveConfig",
    "Curve",
    "ExponentialCurve",
    "ExponentialCurveConfig",
    "FractionPhaseConfig",
    "HoldPhaseConfig",
    "LinearCurve",
    "LinearCurveConfig",
    "Phase",
    "PiecewiseSchedule",
    "PiecewiseScheduleBuilder",
    "PiecewiseScheduleConfig",
    "PolynomialCurve",
    "PolynomialCurveConfig",
    "RestPhaseConfig",
    "StepsPhaseConfig",
    "build_curve",
    "build_lr_schedule",
    "build_lr_scheduler",
    "piecewise_schedule",
    "plot_schedule",
]
