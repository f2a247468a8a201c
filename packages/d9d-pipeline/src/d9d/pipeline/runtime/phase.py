"""Which half of a split backward autograd is running, for custom `autograd.Function`s that can skip the other.

`torch.autograd.grad(..., inputs=...)` does not tell a custom function which of its inputs' gradients are wanted
(`ctx.needs_input_grad` ignores `inputs=`), so a function that computes both halves by hand (the chunked
linear-cross-entropy) would do all the work in both passes. The split backward sets the phase around each pass;
such a function may skip its weight gradients in `INPUT` and its input gradients in `WEIGHT` (returning None),
which the weight pass tolerates because it overrides what reaches every node on the input path. A plain global,
not a context variable: CUDA backward runs on autograd's device threads.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager


class BackwardPhase(enum.Enum):
    FULL = "full"  # an ordinary backward: compute everything
    INPUT = "input"  # only gradients towards the stage input are used
    WEIGHT = "weight"  # only gradients towards parameters are used


_phase = BackwardPhase.FULL


def current_backward_phase() -> BackwardPhase:
    return _phase


@contextmanager
def backward_phase(phase: BackwardPhase) -> Iterator[None]:
    global _phase  # noqa: PLW0603 - see the module docstring: visible to autograd's device threads
    previous, _phase = _phase, phase
    try:
        yield
    finally:
        _phase = previous
