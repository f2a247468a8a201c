"""RoPE frequency scaling for longer contexts: linear (position interpolation), NTK-aware and YaRN.

Each variant is a `*RopeScaling` parameters model (part of a model's hyperparameters); `rope_frequencies` turns
one into the inverse frequencies and the factor applied to cos/sin ("attention factor"), with the same formulas
as Hugging Face's `modeling_rope_utils` for the `linear` and `yarn` types.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, assert_never

import torch
from pydantic import BaseModel, ConfigDict, Field


class LinearRopeScaling(BaseModel):
    """Position interpolation: every frequency divided by `factor`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["linear"] = "linear"
    factor: float = Field(gt=0)


class NtkRopeScaling(BaseModel):
    """NTK-aware scaling (static): the base becomes `theta * factor ** (d / (d - 2))`, stretching low frequencies
    by about `factor` while leaving the highest one unchanged."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["ntk"] = "ntk"
    factor: float = Field(gt=0)


class YarnRopeScaling(BaseModel):
    """YaRN: interpolate low frequencies, keep high ones, ramp in between; scale cos/sin by the attention factor."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["yarn"] = "yarn"
    factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


AnyRopeScaling = Annotated[LinearRopeScaling | NtkRopeScaling | YarnRopeScaling, Field(discriminator="kind")]


def base_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    """`1 / theta^(2i / d)` for `i < d / 2`, in float32."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def rope_frequencies(rotary_dim: int, theta: float, scaling: AnyRopeScaling | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `(rotary_dim / 2,)` (float32, CPU) and the cos/sin scale for `scaling`."""
    match scaling:
        case None:
            return base_frequencies(rotary_dim, theta), 1.0
        case LinearRopeScaling():
            return base_frequencies(rotary_dim, theta) / scaling.factor, 1.0
        case NtkRopeScaling():
            base = theta * scaling.factor ** (rotary_dim / (rotary_dim - 2))
            return base_frequencies(rotary_dim, base), 1.0
        case YarnRopeScaling():
            return _yarn(rotary_dim, theta, scaling)
        case _:
            assert_never(scaling)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, scaling: YarnRopeScaling) -> tuple[torch.Tensor, float]:
    factor = scaling.factor
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    position_frequencies = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolated = 1.0 / position_frequencies
    interpolated = 1.0 / (factor * position_frequencies)
    inverse = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inverse, float(attention_factor)
