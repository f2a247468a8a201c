"""Auxiliary-loss-free MoE balancing as a subscriber of the training loop's events (the loop knows nothing of MoE).

After each step's forward and backward, the routed load of every MoE layer with a router expert bias is summed over
the data-parallel ranks, so every rank applies the same bias update (`TopKRouter.update_expert_bias_`), and the
counters are reset. The largest load over the mean load of each layer is added to the step's metrics.
"""

from __future__ import annotations

from torch import nn

from d9d.core.loop import EventBus, ForwardBackwardFinished
from d9d.core.loop.reduce import sum_tensors_over
from d9d.models.blocks.moe.layer import MoELayer


class MoeBiasBalancer:
    """Subscribes to `ForwardBackwardFinished`; satisfies d9d-core's `EventSubscriber`."""

    def __init__(self, model: nn.Module, rate: float) -> None:
        self._layers = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, MoELayer) and module.router.expert_bias is not None
        }
        self._rate = rate

    def __bool__(self) -> bool:
        return bool(self._layers)

    def subscribe(self, events: EventBus) -> None:
        events.subscribe(ForwardBackwardFinished, self.balance)

    def balance(self, event: ForwardBackwardFinished) -> None:
        local = {name: layer.tokens_per_expert.clone() for name, layer in self._layers.items()}
        loads = sum_tensors_over(local, event.data_parallel_group, event.device)
        for name, layer in self._layers.items():
            layer.router.update_expert_bias_(loads[name], self._rate)
            layer.reset_load()
        for name, load in loads.items():
            event.metrics[f"expert_load_max_over_mean/{name}"] = float(load.max() / load.mean().clamp_min(1e-12))


def moe_bias_balancer(model: nn.Module, rate: float) -> MoeBiasBalancer | None:
    """The model's balancer, or None when no MoE layer has a router expert bias."""
    balancer = MoeBiasBalancer(model, rate)
    return balancer if balancer else None
