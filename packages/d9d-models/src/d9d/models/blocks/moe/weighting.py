"""Weighting of the MoE auxiliary losses when a training step runs as several micro-batches and ranks."""

from __future__ import annotations

import torch
from torch import nn

from d9d.models.blocks.moe.layer import MoELayer


class AuxLossWeights:
    """Sets `aux_loss_weight` on every MoE layer of a model that has an auxiliary-loss coefficient.

    Satisfies d9d-core's `AuxLossWeighting`: the Trainer calls `set_weight(1 / (micro-batches x data-parallel ranks
    x context-parallel ranks))` before each step, so the auxiliary loss that reaches backward is the mean of the
    micro-batches' (shards') values, and after it sums `take_weighted_sum()` over the ranks: the step's auxiliary
    loss, logged as `aux_loss`.
    """

    def __init__(self, model: nn.Module) -> None:
        self._layers = [
            module
            for module in model.modules()
            if isinstance(module, MoELayer) and (module.load_balancing_coef > 0 or module.z_loss_coef > 0)
        ]

    def __bool__(self) -> bool:
        return bool(self._layers)

    def set_weight(self, weight: float) -> None:
        for layer in self._layers:
            layer.aux_loss_weight = weight

    def take_weighted_sum(self) -> float:
        """This rank's weighted auxiliary losses since the last call, over all layers (one device sync)."""
        taken = [value for layer in self._layers if (value := layer.take_weighted_aux_loss()) is not None]
        return float(torch.stack(taken).sum()) if taken else 0.0


def aux_loss_weights(model: nn.Module) -> AuxLossWeights | None:
    """The model's auxiliary-loss weighting, or None when no MoE layer has an auxiliary loss."""
    weights = AuxLossWeights(model)
    return weights if weights else None
