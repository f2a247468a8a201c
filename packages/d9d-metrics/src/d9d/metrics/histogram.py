"""A histogram over fixed bin edges (fixed so every rank's counts add up), with under/overflow, min and max."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from d9d.metrics.metric import Metric, Reduce


@dataclass(frozen=True, kw_only=True)
class HistogramResult:
    edges: list[float]  # len(counts) + 1 increasing edges; bins are [e_i, e_{i+1}), the last one closed
    counts: list[int]
    underflow: int  # values below edges[0]
    overflow: int  # values above edges[-1]
    min: float
    max: float


class HistogramMetric(Metric[HistogramResult]):
    def __init__(self, edges: list[float] | torch.Tensor) -> None:
        super().__init__()
        tensor = torch.as_tensor(edges, dtype=torch.float64)
        if tensor.ndim != 1 or tensor.numel() < 2 or not bool((tensor[1:] > tensor[:-1]).all()):
            raise ValueError(f"HistogramMetric: edges must be >= 2 strictly increasing numbers, got {edges!r}")
        self._edges = tensor
        self.add_state("counts", torch.zeros(tensor.numel() - 1, dtype=torch.float64), Reduce.SUM)
        self.add_state("underflow", 0.0, Reduce.SUM)
        self.add_state("overflow", 0.0, Reduce.SUM)
        self.add_state("min", float("inf"), Reduce.MIN)
        self.add_state("max", float("-inf"), Reduce.MAX)

    def update(self, values: torch.Tensor) -> None:
        flat = values.detach().reshape(-1).to(torch.float64).cpu()
        if not flat.numel():
            return
        edges = self._edges
        inside = (flat >= edges[0]) & (flat <= edges[-1])
        # bucketize with right=True maps v to the number of edges <= v; the last edge closes the last bin.
        index = (torch.bucketize(flat[inside], edges, right=True) - 1).clamp_max(edges.numel() - 2)
        counts = torch.bincount(index, minlength=edges.numel() - 1).to(torch.float64)
        device = self._states["counts"].device
        self._fold("counts", counts.to(device))
        self._fold("underflow", float((flat < edges[0]).sum()))
        self._fold("overflow", float((flat > edges[-1]).sum()))
        self._fold("min", flat.min())
        self._fold("max", flat.max())

    def _compute(self, states: Mapping[str, torch.Tensor]) -> HistogramResult:
        return HistogramResult(
            edges=[float(edge) for edge in self._edges],
            counts=[int(count) for count in states["counts"].tolist()],
            underflow=int(states["underflow"]),
            overflow=int(states["overflow"]),
            min=float(states["min"]),
            max=float(states["max"]),
        )
