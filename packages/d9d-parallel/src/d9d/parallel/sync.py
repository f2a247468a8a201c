"""The gradient-synchronisation interface a training loop drives, and its FSDP implementation."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class GradientSync(Protocol):
    """Per step: `begin_step(n)` (gradients start at zero), `n` backward passes, `wait()` before the optimizer."""

    def begin_step(self, num_microbatches: int) -> None: ...

    def wait(self) -> None: ...


class ModuleGradientSync:
    """For modules that reduce their own gradients during backward (FSDP, HSDP): zeroes them at the step's start."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def begin_step(self, num_microbatches: int) -> None:
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
        self.module.zero_grad(set_to_none=True)

    def wait(self) -> None:
        """FSDP's reductions are complete when backward returns (it waits for them in its final callback)."""
