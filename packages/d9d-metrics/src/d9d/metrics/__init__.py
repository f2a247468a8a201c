"""Distributed-aware metrics (update locally, synchronise asynchronously, compute) and experiment trackers whose run
identity survives resume (`d9d.metrics.trackers`)."""

from d9d.metrics.aggregation import MaxMetric, MeanMetric, MinMetric, SumMetric, WeightedMeanMetric
from d9d.metrics.classification import (
    ClassificationMetric,
    ConfusionMatrixMetric,
    classification_statistic,
    confusion_counts,
)
from d9d.metrics.histogram import HistogramMetric, HistogramResult
from d9d.metrics.language import BitsPerByteMetric, PerplexityMetric
from d9d.metrics.logger import MetricLogger
from d9d.metrics.metric import Metric, Reduce
from d9d.metrics.sync import MetricSync, start_sync, sync
from d9d.metrics.tokens import ThroughputMetric, TokenCountMetric

__all__ = [
    "BitsPerByteMetric",
    "ClassificationMetric",
    "ConfusionMatrixMetric",
    "HistogramMetric",
    "HistogramResult",
    "MaxMetric",
    "MeanMetric",
    "Metric",
    "MetricLogger",
    "MetricSync",
    "MinMetric",
    "PerplexityMetric",
    "Reduce",
    "SumMetric",
    "ThroughputMetric",
    "TokenCountMetric",
    "WeightedMeanMetric",
    "classification_statistic",
    "confusion_counts",
    "start_sync",
    "sync",
]
