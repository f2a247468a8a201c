"""Stochastic rounding of float32 to bfloat16: round up with probability equal to the distance from below.

A bfloat16 is the top 16 bits of a float32. Adding 16 uniform random bits to the low half of the float32's bit
pattern and truncating the low half rounds the magnitude up with probability (remainder / 2^16), so
`E[round(x)] = x` exactly for every finite x (sign and magnitude are separate in the encoding, so negative values
round symmetrically). Round-to-nearest instead loses every update smaller than half a bfloat16 step, which is
why plain bfloat16 AdamW stalls late in training while this does not.

The random bits come from a `torch.Generator` the caller seeds, so results are reproducible.
"""

from __future__ import annotations

import torch

_LOW_HALF = 1 << 16
_HIGH_HALF_MASK = -(1 << 16)  # 0xFFFF0000 as a signed int32


def random_low_bits(shape: torch.Size, *, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Uniform integers in [0, 2^16) as int32: the noise `stochastic_round_to_bf16` adds."""
    return torch.randint(0, _LOW_HALF, shape, generator=generator, dtype=torch.int32, device=device)


def stochastic_round_to_bf16(value: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Round float32 `value` to bfloat16 with `noise` from `random_low_bits` (same shape)."""
    if value.dtype != torch.float32:
        raise ValueError(f"stochastic rounding takes float32 values, got {value.dtype}")
    bits = value.contiguous().view(torch.int32)
    rounded = torch.bitwise_and(bits + noise, _HIGH_HALF_MASK)
    return rounded.view(torch.float32).to(torch.bfloat16)  # exact: the low half is zero


def copy_stochastic_(target: torch.Tensor, value: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
    """Write float32 `value` into `target`: stochastically rounded if `target` is bfloat16, else a plain copy."""
    if target.dtype == torch.bfloat16:
        noise = random_low_bits(value.shape, generator=generator, device=value.device)
        return target.copy_(stochastic_round_to_bf16(value, noise))
    return target.copy_(value)
