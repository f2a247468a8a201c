"""Optimizers: AdamW through PyTorch and AdamW with stochastic rounding for bfloat16 parameters."""

from d9d.core.optim.config import AdamWConfig, AnyOptimizerConfig, StochasticAdamWConfig, build_optimizer
from d9d.core.optim.fused_step import (
    AdamWStepParameters,
    FusedStochasticAdamWMultiStep,
    FusedStochasticAdamWStep,
    register_fused_stochastic_adamw_multi_step,
    register_fused_stochastic_adamw_step,
    registered_fused_stochastic_adamw_multi_step,
    registered_fused_stochastic_adamw_step,
)
from d9d.core.optim.stochastic_adamw import StochasticAdamW
from d9d.core.optim.stochastic_rounding import copy_stochastic_, random_low_bits, stochastic_round_to_bf16

__all__ = [
    "AdamWConfig",
    "AdamWStepParameters",
    "AnyOptimizerConfig",
    "FusedStochasticAdamWMultiStep",
    "FusedStochasticAdamWStep",
    "StochasticAdamW",
    "StochasticAdamWConfig",
    "build_optimizer",
    "copy_stochastic_",
    "random_low_bits",
    "register_fused_stochastic_adamw_multi_step",
    "register_fused_stochastic_adamw_step",
    "registered_fused_stochastic_adamw_multi_step",
    "registered_fused_stochastic_adamw_step",
    "stochastic_round_to_bf16",
]
