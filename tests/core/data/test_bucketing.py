"""Length bucketing: a permutation whose global batches hold similar lengths, random between batches."""

import numpy as np
import pytest

from d9d.core.data import LengthBucketedOrder, bucket_stream, length_bucketed_order


def _lengths(count=1000, seed=0):
    return np.random.default_rng(seed).integers(1, 2000, size=count)


def test_order_is_a_permutation_with_the_remainder_last():
    lengths = _lengths(1003)
    order = length_bucketed_order(lengths, 16, rng=np.random.default_rng(1), window_batches=8)
    assert sorted(order.tolist()) == list(range(1003))
    assert len(order) % 16 == 1003 % 16


def test_batches_are_much_tighter_than_random_ones():
    lengths = _lengths()
    bucketed = length_bucketed_order(lengths, 16, rng=np.random.default_rng(1), window_batches=16)
    shuffled = np.random.default_rng(1).permutation(len(lengths))

    def mean_spread(order):
        full = order[: len(order) - len(order) % 16].reshape(-1, 16)
        return float(np.mean(lengths[full].max(1) - lengths[full].min(1)))

    assert mean_spread(bucketed) < 0.15 * mean_spread(shuffled)


def test_order_depends_on_seed_and_epoch_only():
    lengths = _lengths()
    order = LengthBucketedOrder(lengths, global_batch_size=8, seed=3)
    np.testing.assert_array_equal(order.epoch_order(0), LengthBucketedOrder(lengths, 8, 3).epoch_order(0))
    assert not np.array_equal(order.epoch_order(0), order.epoch_order(1))
    # Batches come in random order, not sorted from short to long.
    means = lengths[order.epoch_order(0)[:992].reshape(-1, 8)].mean(1)
    assert not np.all(np.diff(means) >= 0)


def test_stream_bucketing_yields_every_item_once_in_tight_batches():
    lengths = _lengths(203).tolist()
    batches = list(bucket_stream(iter(lengths), lambda x: x, 8, rng=np.random.default_rng(0), window_batches=5))
    assert sorted(x for batch in batches for x in batch) == sorted(lengths)
    assert [len(batch) for batch in batches].count(8) == 25 and len(batches[-1]) == 3
    spread = np.mean([max(batch) - min(batch) for batch in batches[:-1]])
    assert spread < 0.25 * (max(lengths) - min(lengths))


def test_bad_batch_size_is_refused():
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        length_bucketed_order([1, 2], 0, rng=np.random.default_rng(0))
