"""Rotary position embeddings: frequency tables from position ids, applied in half or interleaved style.

`RotaryEmbedding` turns position ids into cos/sin tables once per forward pass (`RopeTables`), which every
attention layer applies to its queries and keys. Only the first `rotary_dim` channels of a head rotate (partial
rotary); the rest pass through.

Styles: `HALF` pairs channel `i` with `i + rotary_dim / 2` (Llama, Qwen; Hugging Face's `rotate_half`);
`INTERLEAVED` pairs channels `2i` and `2i + 1` (GPT-J, the original RoFormer).

The tables come from one opaque custom op (`d9d_models::rope_tables`). Under whole-model `torch.compile`, Inductor
would otherwise inline the pointwise `cos`/`sin` of the angles into every layer's q/k-norm and rotation kernels,
forward and backward (28 layers x 3 kernels on the dense anchor: ~14 ms of a ~209 ms H100 step, measured), instead
of loading a 1 MiB table computed once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from d9d.models.blocks.rope_scaling import AnyRopeScaling, rope_frequencies


class RopeStyle(enum.StrEnum):
    HALF = "half"
    INTERLEAVED = "interleaved"


@dataclass(frozen=True)
class RopeTables:
    """cos and sin, `(batch, seq, rotary_dim)` in the activation dtype, laid out for `style`."""

    cos: torch.Tensor
    sin: torch.Tensor
    style: RopeStyle

    @property
    def rotary_dim(self) -> int:
        return self.cos.shape[-1]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate `x` of shape `(batch, seq, heads, head_dim)`."""
        rotary_dim = self.rotary_dim
        rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
        cos, sin = self.cos[:, :, None, :], self.sin[:, :, None, :]
        out = rotated * cos + _rotate(rotated, self.style) * sin
        return out if passed.shape[-1] == 0 else torch.cat([out, passed], dim=-1)


def _rotate(x: torch.Tensor, style: RopeStyle) -> torch.Tensor:
    if style == RopeStyle.HALF:
        first, second = x.chunk(2, dim=-1)
        return torch.cat([-second, first], dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([-odd, even], dim=-1).flatten(-2)


@torch.library.custom_op("d9d_models::rope_tables", mutates_args=())
def rope_tables(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, interleaved: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables `(*position_ids.shape, 2 * len(inv_freq))` in `dtype`: angles in float32, scaled by
    `attention_factor`, then cast (as Hugging Face does)."""
    angles = position_ids[..., None].float() * inv_freq.float()
    angles = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat([angles, angles], dim=-1)
    return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)


@rope_tables.register_fake
def _(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, interleaved: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*position_ids.shape, 2 * inv_freq.shape[0])
    return position_ids.new_empty(shape, dtype=dtype), position_ids.new_empty(shape, dtype=dtype)


class RotaryEmbedding(nn.Module):
    """Produces `RopeTables` for position ids. Holds no parameters, only the inverse frequencies."""

    inv_freq: torch.Tensor

    def __init__(
        self,
        *,
        head_dim: int,
        theta: float,
        rotary_dim: int | None = None,
        scaling: AnyRopeScaling | None = None,
        style: RopeStyle = RopeStyle.HALF,
    ) -> None:
        super().__init__()
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if self.rotary_dim % 2 != 0 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={head_dim}]")
        self.theta = theta
        self.scaling = scaling
        self.style = style
        inverse, self.attention_factor = rope_frequencies(self.rotary_dim, theta, scaling)
        self.register_buffer("inv_freq", inverse, persistent=False)

    def reset_parameters(self) -> None:
        inverse, _ = rope_frequencies(self.rotary_dim, self.theta, self.scaling)
        with torch.no_grad():
            self.inv_freq.copy_(inverse.to(self.inv_freq.device))

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """Tables for `position_ids` `(batch, seq)`: angles in float32, cast to `dtype` (as Hugging Face does)."""
        interleaved = self.style == RopeStyle.INTERLEAVED
        cos, sin = rope_tables(position_ids, self.inv_freq, float(self.attention_factor), interleaved, dtype)
        return RopeTables(cos=cos, sin=sin, style=self.style)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, theta={self.theta}, style={self.style.value}, scaling={self.scaling}"
