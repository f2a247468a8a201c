"""Capacity limit with token dropping: each expert takes at most `ceil(factor * T * k / E)` copies per rank."""

from __future__ import annotations

import math

import torch

from d9d.kernels.expert_dispatch import count_per_expert


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def drop_over_capacity(expert_indices: torch.Tensor, num_experts: int, capacity_factor: float) -> torch.Tensor:
    """`expert_indices` `(T, k)` with the copies beyond each expert's capacity set to `-1` (dropped).

    Copies are admitted in flat `(token, slot)` order, so earlier tokens win; a dropped copy adds nothing to its
    token's output (the residual carries the token), as in Switch Transformer and GShard.
    """
    num_tokens, top_k = expert_indices.shape
    capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
    flat = expert_indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = count_per_expert(flat, num_experts)
    starts = torch.cumsum(counts, dim=0) - counts
    position_sorted = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    position = torch.empty_like(position_sorted)
    position[order] = position_sorted
    return torch.where(position < capacity, flat, torch.full_like(flat, -1)).view(num_tokens, top_k)
