"""The job wiring registers the fused AdamW step a `StochasticAdamWConfig(fused=True)` asks for."""

import importlib.util

import pytest

from d9d.core.optim import AdamWConfig, StochasticAdamWConfig
from d9d.core.optim import fused_step as fused_step_module
from d9d.flows.jobs.optimizer_kernels import register_optimizer_kernels


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fused_stochastic_adamw_config_registers_the_triton_step(monkeypatch):
    from d9d.kernels.adamw import triton_stochastic_adamw_multi_step, triton_stochastic_adamw_step

    monkeypatch.setattr(fused_step_module, "_registered", [])
    monkeypatch.setattr(fused_step_module, "_registered_multi", [])
    register_optimizer_kernels(AdamWConfig())
    register_optimizer_kernels(StochasticAdamWConfig())
    assert fused_step_module._registered == []  # nothing asked for a fused step
    register_optimizer_kernels(StochasticAdamWConfig(fused=True))
    assert fused_step_module.registered_fused_stochastic_adamw_step() is triton_stochastic_adamw_step
    assert fused_step_module.registered_fused_stochastic_adamw_multi_step() is triton_stochastic_adamw_multi_step
