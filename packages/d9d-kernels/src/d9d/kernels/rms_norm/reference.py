"""The eager RMSNorm (with the optional residual add) every other backend is tested against.

As Hugging Face's Qwen3/Llama: statistics in float32, the normalised row cast back to the activation dtype, then
scaled by the weight (so a float32 weight gives a float32 output).
"""

from __future__ import annotations

import torch


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, *, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weight * normalise(x + residual), x + residual)`; without `residual` the second item is `x` itself."""
    summed = x if residual is None else x + residual
    x32 = summed.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(summed.dtype), summed
