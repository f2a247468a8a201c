"""Grouped-query attention with optional q/k RMSNorm and rotary embeddings; the kernel is a pluggable backend."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels.attention import AttentionBackend, AttentionMask
from d9d.kernels.rope import EagerRope, RopeKernel
from d9d.models.blocks.late_init import init_normal_, init_zeros_
from d9d.models.blocks.linear import DeferrableLinear
from d9d.models.blocks.norm import RMSNorm
from d9d.models.blocks.rope import RopeStyle, RopeTables


class GroupedQueryAttention(nn.Module):
    """`num_heads` query heads share `num_kv_heads` key/value heads; q/k are RMS-normalised per head (Qwen3) when
    `qk_norm`. `backend` computes the attention itself and may be swapped at any time (the experiment seam)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: AttentionBackend,
        qk_norm: bool = True,
        norm_eps: float = 1e-6,
        bias: bool = False,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.init_std = init_std
        self.backend = backend
        self.q_proj = DeferrableLinear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = DeferrableLinear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = DeferrableLinear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = DeferrableLinear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.rope_kernel: RopeKernel = EagerRope()  # rotates q and k together (one Triton launch when swapped in)

    def reset_parameters(self) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            init_normal_(linear.weight, self.init_std)
            if linear.bias is not None:
                init_zeros_(linear.bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def forward(self, hidden: torch.Tensor, rope: RopeTables, mask: AttentionMask) -> torch.Tensor:
        batch, seq, _ = hidden.shape
        # -1 heads: under tensor parallelism the projections hold this rank's heads only.
        query = self.q_proj(hidden).view(batch, seq, -1, self.head_dim)
        key = self.k_proj(hidden).view(batch, seq, -1, self.head_dim)
        value = self.v_proj(hidden).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = self.rope_kernel(query, key, rope.cos, rope.sin, interleaved=rope.style == RopeStyle.INTERLEAVED)
        out = self.backend(query, key, value, mask=mask, scale=self.head_dim**-0.5)
        projected: torch.Tensor = self.o_proj(out.reshape(batch, seq, -1))
        return projected
