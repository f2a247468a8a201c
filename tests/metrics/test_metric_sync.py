"""Every metric synchronised over 4 gloo ranks equals the single-process computation over the union of the data.

Each rank draws its own shard of data from a rank-seeded generator (different sizes per rank, so a rank-count
average would be wrong); the reference is the same metric updated in one process with all four shards. Sums of
float64 in another order differ in the last bits, hence `rel=1e-12` for real-valued results and exact equality
for counts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from d9d.metrics import (
    BitsPerByteMetric,
    ClassificationMetric,
    ConfusionMatrixMetric,
    HistogramMetric,
    MaxMetric,
    MeanMetric,
    Metric,
    MinMetric,
    PerplexityMetric,
    SumMetric,
    ThroughputMetric,
    TokenCountMetric,
    WeightedMeanMetric,
    start_sync,
)

WORLD = 4
CLASSES = 4


def _shard(rank: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(100 + rank)
    size = 5 + 7 * rank  # unequal shards
    return {
        "values": torch.randn(size, generator=generator, dtype=torch.float64) * 3,
        "weights": torch.rand(size, generator=generator, dtype=torch.float64),
        "tokens": int(torch.randint(10, 100, (1,), generator=generator)),
        "bytes": int(torch.randint(40, 400, (1,), generator=generator)),
        "seconds": 0.5 + rank * 0.25,
        "scores": torch.randn(size, CLASSES, generator=generator),
        "targets": torch.randint(0, CLASSES, (size,), generator=generator),
    }


def _feed(metrics: dict[str, Metric[Any]], shard: dict[str, Any]) -> None:
    values = shard["values"]
    metrics["sum"].update(values)
    metrics["mean"].update(values)
    metrics["weighted_mean"].update(values, shard["weights"])
    metrics["min"].update(values)
    metrics["max"].update(values)
    metrics["tokens"].update(shard["tokens"])
    metrics["throughput"].update(shard["tokens"], shard["seconds"])
    metrics["perplexity"].update(values.abs().sum(), shard["tokens"])
    metrics["bits_per_byte"].update(values.abs().sum(), shard["bytes"])
    metrics["histogram"].update(values)
    metrics["confusion"].update(shard["scores"], shard["targets"])
    for name, metric in metrics.items():
        if name.startswith(("accuracy", "precision", "recall", "f1")):
            metric.update(shard["scores"], shard["targets"])


def _catalogue() -> dict[str, Metric[Any]]:
    metrics: dict[str, Metric[Any]] = {
        "sum": SumMetric(),
        "mean": MeanMetric(),
        "weighted_mean": WeightedMeanMetric(),
        "min": MinMetric(),
        "max": MaxMetric(),
        "tokens": TokenCountMetric(),
        "throughput": ThroughputMetric(),
        "perplexity": PerplexityMetric(),
        "bits_per_byte": BitsPerByteMetric(),
        "histogram": HistogramMetric([-4.0, -2.0, -1.0, 0.0, 1.0, 2.0, 4.0]),
        "confusion": ConfusionMatrixMetric(CLASSES),
    }
    for statistic in ("accuracy", "precision", "recall", "f1"):
        for average in ("micro", "macro", "weighted"):
            metrics[f"{statistic}_{average}"] = ClassificationMetric(CLASSES, statistic=statistic, average=average)
    return metrics


def _assert_same(name: str, synced: Any, reference: Any) -> None:
    if isinstance(synced, torch.Tensor):
        assert torch.equal(synced, reference), name
    elif isinstance(synced, float):
        assert synced == pytest.approx(reference, rel=1e-12), name
    else:
        assert synced == reference, name


@pytest.mark.distributed(world_size=WORLD)
def test_every_metric_synced_over_four_ranks_equals_one_process_over_the_union():
    rank = dist.get_rank()
    metrics = _catalogue()
    _feed(metrics, _shard(rank))
    pending = start_sync(metrics)  # returns at once; the reductions run while this rank does other work
    local_after_start = metrics["sum"].compute()
    metrics["sum"].update(1000.0)  # the in-flight sync works on a copy: later updates do not leak into it
    results = pending.results()

    reference = _catalogue()
    for other in range(WORLD):
        _feed(reference, _shard(other))
    for name, metric in reference.items():
        if name != "throughput":  # one process would run the shards one after another: its seconds add up
            _assert_same(name, results[name], metric.compute())
    assert metrics["sum"].compute() == pytest.approx(local_after_start + 1000.0)
    # Throughput is summed tokens over the slowest rank's time, not summed time.
    total_tokens = sum(_shard(other)["tokens"] for other in range(WORLD))
    assert results["throughput"] == pytest.approx(total_tokens / (0.5 + 3 * 0.25))


@pytest.mark.distributed(world_size=WORLD)
def test_a_rank_without_data_leaves_min_max_and_means_to_the_others():
    rank = dist.get_rank()
    metrics: dict[str, Metric[Any]] = {"min": MinMetric(), "max": MaxMetric(), "mean": MeanMetric()}
    if rank != 2:
        for metric in metrics.values():
            metric.update(torch.tensor([float(rank), float(rank) + 0.5]))
    results = start_sync(metrics).results()
    assert results == {"min": 0.0, "max": 3.5, "mean": pytest.approx((0 + 0.5 + 1 + 1.5 + 3 + 3.5) / 6)}
