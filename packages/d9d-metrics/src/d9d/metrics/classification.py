"""Multiclass classification from a confusion matrix: accuracy, precision, recall and F1, averaged micro, macro
or weighted.

The state is the C x C confusion matrix (rows: true class, columns: predicted class). It sums exactly over ranks,
so every statistic of the synced matrix equals the single-process one. The averages follow scikit-learn with
`labels=None`: an undefined ratio (a class never predicted, for precision) counts as 0 (`zero_division=0`); macro
averages leave out classes that never occur (in neither targets nor predictions; balanced accuracy: not in the
targets). Every statistic is NaN before any data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import torch

from d9d.metrics.metric import Metric, Reduce

Statistic = Literal["accuracy", "precision", "recall", "f1"]
Average = Literal["micro", "macro", "weighted"]
STATISTICS: tuple[Statistic, ...] = ("accuracy", "precision", "recall", "f1")
AVERAGES: tuple[Average, ...] = ("micro", "macro", "weighted")


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    return torch.where(denominator > 0, numerator / denominator.clamp_min(1e-300), torch.zeros_like(numerator))


def confusion_counts(
    predictions: torch.Tensor, targets: torch.Tensor, num_classes: int, ignore_index: int | None = None
) -> torch.Tensor:
    """The C x C float64 counts of (true, predicted) pairs; `predictions` are class indices, or scores with one
    extra last dimension (argmax taken)."""
    if predictions.ndim == targets.ndim + 1:
        if predictions.shape[-1] != num_classes:
            raise ValueError(f"predictions have {predictions.shape[-1]} scores per item, num_classes is {num_classes}")
        predictions = predictions.argmax(dim=-1)
    if predictions.shape != targets.shape:
        raise ValueError(
            f"predictions shape {tuple(predictions.shape)} does not match targets {tuple(targets.shape)}; "
            "pass class indices of the same shape, or scores with one extra last dimension"
        )
    predicted, true = predictions.detach().reshape(-1).long(), targets.detach().reshape(-1).long()
    if ignore_index is not None:
        keep = true != ignore_index
        predicted, true = predicted[keep], true[keep]
    for name, values in (("predictions", predicted), ("targets", true)):
        if values.numel() and (int(values.min()) < 0 or int(values.max()) >= num_classes):
            raise ValueError(
                f"{name} hold classes {int(values.min())}..{int(values.max())}; valid: 0..{num_classes - 1}"
            )
    pairs = torch.bincount(true * num_classes + predicted, minlength=num_classes**2)
    return pairs.reshape(num_classes, num_classes).to(torch.float64)


def _check_classes(num_classes: int) -> None:
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")


class ConfusionMatrixMetric(Metric[torch.Tensor]):
    """The confusion matrix itself (rows: true class, columns: predicted class)."""

    def __init__(self, num_classes: int, *, ignore_index: int | None = None) -> None:
        super().__init__()
        _check_classes(num_classes)
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.add_state("matrix", torch.zeros(num_classes, num_classes), Reduce.SUM)

    def update(self, predictions: torch.Tensor, targets: torch.Tensor) -> None:
        counts = confusion_counts(predictions, targets, self.num_classes, self.ignore_index)
        self._fold("matrix", counts.to(self._states["matrix"].device))

    def _compute(self, states: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return states["matrix"].clone()


def classification_statistic(matrix: torch.Tensor, statistic: Statistic, average: Average) -> float:
    """One statistic of a confusion matrix (rows true, columns predicted)."""
    true_positive = matrix.diagonal()
    support = matrix.sum(dim=1)  # items of each true class
    predicted = matrix.sum(dim=0)  # items predicted as each class
    total = matrix.sum()
    if not total:
        return math.nan  # no data, as the other metrics
    if average == "micro":
        # Single-label multiclass: micro precision, recall, F1 and accuracy all equal trace / total.
        return float(_ratio(true_positive.sum(), total))
    precision = _ratio(true_positive, predicted)
    recall = _ratio(true_positive, support)
    per_class = {
        "accuracy": recall,  # per-class accuracy in the multiclass sense: the class's recall (balanced accuracy)
        "precision": precision,
        "recall": recall,
        "f1": _ratio(2 * precision * recall, precision + recall),
    }[statistic]
    if average == "macro":
        # scikit-learn (labels=None) averages over the classes that occur: in the targets or the predictions for
        # precision, recall and F1; in the targets for balanced accuracy.
        present = support > 0 if statistic == "accuracy" else (support > 0) | (predicted > 0)
        return float(per_class[present].mean())
    return float(_ratio((per_class * support).sum(), support.sum()))


class ClassificationMetric(Metric[float]):
    """Accuracy, precision, recall or F1 of a multiclass problem, micro/macro/weighted averaged.

    >>> metric = ClassificationMetric(3, statistic="f1", average="macro")
    """

    def __init__(
        self, num_classes: int, *, statistic: Statistic, average: Average = "micro", ignore_index: int | None = None
    ) -> None:
        super().__init__()
        if statistic not in STATISTICS:
            raise ValueError(f"statistic={statistic!r}; valid: {', '.join(STATISTICS)}")
        if average not in AVERAGES:
            raise ValueError(f"average={average!r}; valid: {', '.join(AVERAGES)}")
        _check_classes(num_classes)
        self.statistic: Statistic = statistic
        self.average: Average = average
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.add_state("matrix", torch.zeros(num_classes, num_classes), Reduce.SUM)

    def update(self, predictions: torch.Tensor, targets: torch.Tensor) -> None:
        counts = confusion_counts(predictions, targets, self.num_classes, self.ignore_index)
        self._fold("matrix", counts.to(self._states["matrix"].device))

    def _compute(self, states: Mapping[str, torch.Tensor]) -> float:
        return classification_statistic(states["matrix"], self.statistic, self.average)
