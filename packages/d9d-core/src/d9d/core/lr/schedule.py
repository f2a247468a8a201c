"""A piecewise schedule of learning-rate multipliers, and its PyTorch scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from d9d.core.lr.curves import Curve


@dataclass(frozen=True)
class Phase:
    """Steps `[start_step, end_step)` move the multiplier from `start_value` towards `end_value` along `curve`.

    At `start_step` the multiplier is `start_value`; `end_value` is reached at `end_step`, the next phase's first
    step.
    """

    start_step: int
    end_step: int
    start_value: float
    end_value: float
    curve: Curve

    def value(self, step: int) -> float:
        progress = (step - self.start_step) / (self.end_step - self.start_step)
        return self.curve.value(self.start_value, self.end_value, progress)


@dataclass(frozen=True)
class PiecewiseSchedule:
    """Multiplier of the base learning rate per step; after the last phase it stays at `final_value`."""

    phases: tuple[Phase, ...]
    final_value: float
    total_steps: int

    def multiplier(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must not be negative, got {step}")
        for phase in self.phases:
            if phase.start_step <= step < phase.end_step:
                return phase.value(step)
        return self.final_value

    def multipliers(self, num_steps: int | None = None) -> list[float]:
        return [self.multiplier(step) for step in range(self.total_steps if num_steps is None else num_steps)]

    def scheduler(self, optimizer: Optimizer) -> LambdaLR:
        """A `LambdaLR` applying this schedule to every parameter group (its state is just the step count)."""
        schedule = self

        def multiplier(step: int) -> float:
            return schedule.multiplier(step)

        return LambdaLR(optimizer, multiplier)
