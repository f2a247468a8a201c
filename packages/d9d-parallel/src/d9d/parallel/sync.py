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
    """For modules that reduce their own gradients during backward (FSDP, HSDP): clears them at the step's start.

    The parameters are collected at the first `begin_step` (after materialisation) and each step clears that list's
    gradients, not the module tree's: walking it costs milliseconds of host time at the anchors' sizes.
    FSDP swaps unsharded parameters in only during forward and backward; between steps the module holds the same
    sharded `Parameter` objects.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._parameters: list[nn.Parameter] | None = None

    def begin_step(self, num_microbatches: int) -> None:
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
        if self._parameters is None:
            self._parameters = list(self.module.parameters())
        for param in self._parameters:
            param.grad = None

    def wait(self) -> None:
        """FSDP's reductions are complete when backward returns (it waits for them in its final callback)."""
