"""The gradient-synchronisation interface a training loop drives, and its FSDP implementation."""

from __future__ import annotations

from collections.abc import Callable, Iterable
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

    `select` picks the parameters to clear (default: all of them), e.g. `d9d.parallel.placed_parameters` for the
    experts beside a replicated dense domain, whose gradients are whole on their rank and need no reduction.
    """

    def __init__(self, module: nn.Module, select: Callable[[nn.Module], Iterable[nn.Parameter]] | None = None) -> None:
        self.module = module
        self._select = select
        self._parameters: list[nn.Parameter] | None = None

    def begin_step(self, num_microbatches: int) -> None:
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
        if self._parameters is None:
            chosen = self.module.parameters() if self._select is None else self._select(self.module)
            self._parameters = list(chosen)
        for param in self._parameters:
            param.grad = None

    def wait(self) -> None:
        """FSDP's reductions are complete when backward returns (it waits for them in its final callback)."""


class GradientSyncs:
    """Several synchronisers driven as one, in the given order (e.g. clearing placed expert gradients, then the
    replicated parameters' bucketed all-reduce)."""

    def __init__(self, *syncs: GradientSync) -> None:
        if not syncs:
            raise ValueError("GradientSyncs needs at least one synchroniser")
        self.syncs = syncs

    def begin_step(self, num_microbatches: int) -> None:
        for sync in self.syncs:
            sync.begin_step(num_microbatches)

    def wait(self) -> None:
        for sync in self.syncs:
            sync.wait()
