"""Metrics of the routed expert load: each expert's share and the layer's imbalance."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def expert_load_metrics(loads: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """From loads per MoE layer (routed copies per *global* expert, summed over the data ranks, e.g.
    `ExpertLoadsReduced.loads`): `expert_load/<layer>/<e>`, expert `e`'s share of the layer's copies, and
    `expert_imbalance/<layer>`, the busiest expert's load over the mean (1 is perfect balance).

    Under expert parallelism every rank counts what its own router chose before dispatch, so the summed loads are
    the same whatever `ep` is.
    """
    metrics: dict[str, float] = {}
    for layer, load in sorted(loads.items()):
        values = load.detach().float().cpu()
        total = float(values.sum())
        for expert, count in enumerate(values.tolist()):
            metrics[f"expert_load/{layer}/{expert}"] = count / total if total > 0 else 0.0
        metrics[f"expert_imbalance/{layer}"] = float(values.max() / values.mean().clamp_min(1e-12))
    return metrics
