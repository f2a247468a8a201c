"""A fluent builder for piecewise schedules: warm-up, hold and decay phases, in steps or fractions of the run.

schedule = (
    piecewise_schedule(total_steps=1000, initial=0.0)
    .for_steps(100, target=1.0, curve=LinearCurve())     # warm-up
    .hold(200)                                           # stay at 1.0
    .until_fraction(0.9, target=0.1, curve=CosineCurve()) # decay until step 900
    .fill_rest(target=0.0)                               # linear to 0 at the end
    .build()
)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from d9d.core.lr.curves import Curve, LinearCurve
from d9d.core.lr.schedule import Phase, PiecewiseSchedule


@dataclass
class PiecewiseScheduleBuilder:
    total_steps: int
    initial: float
    phases: list[Phase] = field(default_factory=list)
    _closed: bool = False

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be at least 1, got {self.total_steps}")

    @property
    def step(self) -> int:
        return self.phases[-1].end_step if self.phases else 0

    @property
    def value(self) -> float:
        return self.phases[-1].end_value if self.phases else self.initial

    def for_steps(self, steps: int, target: float, curve: Curve | None = None) -> PiecewiseScheduleBuilder:
        """Move to `target` over the next `steps` steps."""
        if steps < 1:
            raise ValueError(f"a phase needs at least one step, got steps={steps}")
        return self._add(self.step + steps, target, curve or LinearCurve(), what=f"for_steps({steps})")

    def hold(self, steps: int) -> PiecewiseScheduleBuilder:
        """Keep the current value for `steps` steps."""
        return self.for_steps(steps, self.value, LinearCurve())

    def until_fraction(self, fraction: float, target: float, curve: Curve | None = None) -> PiecewiseScheduleBuilder:
        """Move to `target` by step `round(fraction * total_steps)`."""
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must lie in (0, 1], got {fraction}")
        end = round(fraction * self.total_steps)
        return self._add(end, target, curve or LinearCurve(), what=f"until_fraction({fraction})")

    def fill_rest(self, target: float, curve: Curve | None = None) -> PiecewiseScheduleBuilder:
        """Move to `target` by the last step; closes the schedule."""
        builder = self._add(self.total_steps, target, curve or LinearCurve(), what="fill_rest")
        builder._closed = True
        return builder

    def build(self) -> PiecewiseSchedule:
        return PiecewiseSchedule(phases=tuple(self.phases), final_value=self.value, total_steps=self.total_steps)

    def _add(self, end: int, target: float, curve: Curve, *, what: str) -> PiecewiseScheduleBuilder:
        if self._closed:
            raise ValueError(f"{what} comes after fill_rest, which already ends the schedule")
        if end <= self.step:
            raise ValueError(
                f"{what} would end at step {end}, but the schedule already reaches step {self.step}; phases must "
                "move forward"
            )
        if end > self.total_steps:
            raise ValueError(f"{what} would end at step {end}, past total_steps={self.total_steps}")
        phase = Phase(start_step=self.step, end_step=end, start_value=self.value, end_value=target, curve=curve)
        phase.value(phase.start_step)  # fail now, not mid-run, on an impossible curve (exponential through 0)
        self.phases.append(phase)
        return self


def piecewise_schedule(total_steps: int, initial: float = 0.0) -> PiecewiseScheduleBuilder:
    return PiecewiseScheduleBuilder(total_steps=total_steps, initial=initial)
