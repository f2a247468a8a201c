"""Kernels an optimizer config asks for, registered before the optimizer is built (the wiring's one place for it)."""

from __future__ import annotations

from d9d.core.optim import AnyOptimizerConfig, StochasticAdamWConfig


def register_optimizer_kernels(config: AnyOptimizerConfig) -> None:
    """`StochasticAdamWConfig(fused=True)` runs d9d-kernels' Triton step: register it (needs the `triton` extra)."""
    if isinstance(config, StochasticAdamWConfig) and config.fused:
        from d9d.kernels.adamw import register_triton_stochastic_adamw

        register_triton_stochastic_adamw()
