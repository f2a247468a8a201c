"""Curves that carry a value from `start` to `end` as progress goes from 0 to 1."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class Curve(Protocol):
    def value(self, start: float, end: float, progress: float) -> float: ...


@dataclass(frozen=True)
class LinearCurve:
    def value(self, start: float, end: float, progress: float) -> float:
        return start + (end - start) * progress


@dataclass(frozen=True)
class CosineCurve:
    """Half a cosine: flat at both ends, steepest in the middle."""

    def value(self, start: float, end: float, progress: float) -> float:
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class PolynomialCurve:
    """`end + (start - end) * (1 - progress) ** power`: power 1 is linear, larger powers drop faster at first."""

    power: float = 2.0

    def value(self, start: float, end: float, progress: float) -> float:
        return float(end + (start - end) * (1.0 - progress) ** self.power)


@dataclass(frozen=True)
class ExponentialCurve:
    """Geometric interpolation `start * (end / start) ** progress`; both ends must be positive."""

    def value(self, start: float, end: float, progress: float) -> float:
        if start <= 0 or end <= 0:
            raise ValueError(
                f"an exponential curve needs positive ends, got {start} -> {end}; use a small positive value "
                "(e.g. 1e-3) instead of 0, or another curve"
            )
        return float(start * (end / start) ** progress)
