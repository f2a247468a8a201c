"""Mixture of experts: router, grouped experts, permutation, auxiliary losses, the layer."""

from d9d.models.blocks.moe.capacity import drop_over_capacity, expert_capacity
from d9d.models.blocks.moe.expert_parallel import parallelize_experts
from d9d.models.blocks.moe.experts import GroupedLinear, GroupedSwiGLU, LocalShardGroupedMm
from d9d.models.blocks.moe.layer import MoELayer
from d9d.models.blocks.moe.load import expert_load_metrics
from d9d.models.blocks.moe.losses import attach_aux_loss, load_balancing_loss, router_z_loss
from d9d.models.blocks.moe.permute import PermutedTokens, permute_tokens, unpermute_tokens
from d9d.models.blocks.moe.router import RouterScoring, RoutingResult, TopKRouter, force_routing
from d9d.models.blocks.moe.weighting import AuxLossWeights, aux_loss_weights

__all__ = [
    "AuxLossWeights",
    "GroupedLinear",
    "GroupedSwiGLU",
    "LocalShardGroupedMm",
    "MoELayer",
    "PermutedTokens",
    "RouterScoring",
    "RoutingResult",
    "TopKRouter",
    "attach_aux_loss",
    "aux_loss_weights",
    "drop_over_capacity",
    "expert_capacity",
    "expert_load_metrics",
    "force_routing",
    "load_balancing_loss",
    "parallelize_experts",
    "permute_tokens",
    "router_z_loss",
    "unpermute_tokens",
]
