"""The catalogue in one process against plain references: hand-written classification counts, torch.histogram,
math on the raw numbers; checkpoint state round trips; bad input names the field."""

from __future__ import annotations

import math

import pytest
import torch

from d9d.metrics import (
    BitsPerByteMetric,
    ClassificationMetric,
    ConfusionMatrixMetric,
    HistogramMetric,
    MeanMetric,
    PerplexityMetric,
    WeightedMeanMetric,
    sync,
)


def _reference_scores(predicted: list[int], true: list[int], classes: int) -> dict[str, float]:
    """Per-class counts by loops, then the averages as scikit-learn defines them (zero_division=0)."""
    scores: dict[str, float] = {}
    tp = [sum(p == c and t == c for p, t in zip(predicted, true, strict=True)) for c in range(classes)]
    fp = [sum(p == c and t != c for p, t in zip(predicted, true, strict=True)) for c in range(classes)]
    fn = [sum(p != c and t == c for p, t in zip(predicted, true, strict=True)) for c in range(classes)]
    support = [tp[c] + fn[c] for c in range(classes)]
    precision = [tp[c] / (tp[c] + fp[c]) if tp[c] + fp[c] else 0.0 for c in range(classes)]
    recall = [tp[c] / support[c] if support[c] else 0.0 for c in range(classes)]
    f1 = [2 * p * r / (p + r) if p + r else 0.0 for p, r in zip(precision, recall, strict=True)]
    for name, per_class in (("precision", precision), ("recall", recall), ("f1", f1), ("accuracy", recall)):
        scores[f"{name}_macro"] = sum(per_class) / classes
        scores[f"{name}_weighted"] = sum(v * s for v, s in zip(per_class, support, strict=True)) / sum(support)
        scores[f"{name}_micro"] = sum(tp) / len(true)
    return scores


def test_classification_statistics_match_hand_counted_references():
    generator = torch.Generator().manual_seed(0)
    true = torch.randint(0, 5, (200,), generator=generator)
    predicted = torch.where(torch.rand(200, generator=generator) < 0.6, true, torch.randint(0, 5, (200,)))
    predicted[predicted == 4] = 3  # class 4 is never predicted: its precision is undefined, counted as 0
    reference = _reference_scores(predicted.tolist(), true.tolist(), 5)
    for key, expected in reference.items():
        statistic, average = key.split("_")
        metric = ClassificationMetric(5, statistic=statistic, average=average)  # type: ignore[arg-type]
        for chunk in range(0, 200, 64):  # several updates accumulate
            metric.update(predicted[chunk : chunk + 64], true[chunk : chunk + 64])
        assert metric.compute() == pytest.approx(expected, abs=1e-12), key


# 6 classes: 5 occurs nowhere, 4 is only predicted, 3 only in the targets (so macro averages differ from a plain
# mean over 6 classes). Expected values printed once by scikit-learn 1.9.1 (labels=None, zero_division=0):
# precision_score / recall_score / f1_score(average=...), accuracy_score (micro), balanced_accuracy_score (macro
# accuracy) and recall_score(average="weighted") (weighted accuracy).
SKLEARN_TRUE = [0, 1, 0, 2, 2, 0, 0, 0, 0, 2, 3, 1, 0, 0, 3, 3, 1, 1, 0, 0, 1, 0, 0, 1]
SKLEARN_PRED = [1, 1, 0, 1, 2, 2, 1, 0, 0, 4, 0, 4, 1, 4, 0, 0, 1, 1, 0, 0, 0, 0, 1, 2]
SKLEARN_SCORES = {
    "precision_micro": 0.4166666666666667,
    "recall_micro": 0.4166666666666667,
    "f1_micro": 0.4166666666666667,
    "precision_macro": 0.26166666666666666,
    "recall_macro": 0.26666666666666666,
    "f1_macro": 0.26147186147186147,
    "precision_weighted": 0.4354166666666666,
    "recall_weighted": 0.4166666666666667,
    "f1_weighted": 0.4215367965367965,
    "accuracy_micro": 0.4166666666666667,
    "accuracy_macro": 0.3333333333333333,
    "accuracy_weighted": 0.4166666666666667,
}


@pytest.mark.parametrize("key", sorted(SKLEARN_SCORES))
def test_classification_matches_scikit_learn_when_some_classes_never_occur(key):
    statistic, average = key.split("_")
    metric = ClassificationMetric(6, statistic=statistic, average=average)  # type: ignore[arg-type]
    metric.update(torch.tensor(SKLEARN_PRED), torch.tensor(SKLEARN_TRUE))
    assert metric.compute() == pytest.approx(SKLEARN_SCORES[key], abs=1e-12)
    perfect = ClassificationMetric(4, statistic=statistic, average=average)  # type: ignore[arg-type]
    perfect.update(torch.tensor([0, 1, 0, 1]), torch.tensor([0, 1, 0, 1]))  # classes 2 and 3 never occur
    assert perfect.compute() == 1.0  # scikit-learn: 1.0 for every statistic and average
    assert math.isnan(ClassificationMetric(4, statistic=statistic, average=average).compute())  # type: ignore[arg-type]


def test_confusion_matrix_takes_scores_and_ignores_an_index():
    metric = ConfusionMatrixMetric(3, ignore_index=-100)
    scores = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    metric.update(scores, torch.tensor([1, 2, 2, -100]))
    expected = torch.zeros(3, 3, dtype=torch.float64)
    expected[1, 1] = expected[2, 0] = expected[2, 2] = 1
    assert torch.equal(metric.compute(), expected)


def test_histogram_matches_torch_histogram_inside_the_edges():
    values = torch.randn(1000, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2
    edges = torch.linspace(-3, 3, 13, dtype=torch.float64)
    metric = HistogramMetric(edges)
    metric.update(values[:300])
    metric.update(values[300:])
    result = metric.compute()
    inside = values[(values >= -3) & (values <= 3)]
    assert result.counts == torch.histogram(inside, bins=edges).hist.long().tolist()
    assert result.underflow == int((values < -3).sum()) and result.overflow == int((values > 3).sum())
    assert (result.min, result.max) == (float(values.min()), float(values.max()))


def test_perplexity_and_bits_per_byte_weigh_batches_by_their_tokens_and_bytes():
    perplexity, bits = PerplexityMetric(), BitsPerByteMetric()
    for loss_sum, tokens, num_bytes in ((12.0, 4, 10), (3.0, 2, 9)):
        perplexity.update(torch.tensor(loss_sum), tokens)
        bits.update(loss_sum, num_bytes)
    assert perplexity.compute() == pytest.approx(math.exp(15.0 / 6))
    assert bits.compute() == pytest.approx(15.0 / (math.log(2) * 19))
    assert math.isnan(PerplexityMetric().compute())


def test_perplexity_of_a_diverged_step_is_inf_not_an_overflow_error():
    diverged = PerplexityMetric()
    diverged.update(torch.tensor(800.0), 1)  # exp(800) exceeds a float64 (largest exp argument ~709.78)
    assert diverged.compute() == math.inf
    just_below = PerplexityMetric()
    just_below.update(709.0, 1)
    assert just_below.compute() == pytest.approx(math.exp(709.0))


def test_state_dict_round_trips_and_reset_restores_defaults():
    metric = WeightedMeanMetric()
    metric.update(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 3.0]))
    restored = WeightedMeanMetric()
    restored.load_state_dict(metric.state_dict())
    assert restored.compute() == metric.compute() == pytest.approx(10 / 4)
    restored.reset()
    assert math.isnan(restored.compute())


def test_without_a_process_group_sync_is_the_local_result():
    metric = MeanMetric()
    metric.update(torch.tensor([1.0, 2.0]))
    assert sync(metric) == 1.5


def test_bad_input_names_the_field_and_what_is_valid():
    with pytest.raises(ValueError, match=r"statistic='f2'; valid: accuracy, precision, recall, f1"):
        ClassificationMetric(3, statistic="f2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"targets hold classes 0..3; valid: 0..2"):
        ConfusionMatrixMetric(3).update(torch.tensor([0, 1]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"edges must be >= 2 strictly increasing"):
        HistogramMetric([0.0, 0.0])
    with pytest.raises(ValueError, match=r"weight must be >= 0"):
        WeightedMeanMetric().update(1.0, -1.0)
    with pytest.raises(KeyError, match=r"missing states \['count'\]"):
        MeanMetric().load_state_dict({"sum": torch.tensor(1.0)})
