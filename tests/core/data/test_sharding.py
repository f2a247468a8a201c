"""Data-parallel sharding: every rank gets equally many samples (drop or pad), and together exactly the data."""

import itertools

import pytest

from d9d.core.data import ShardedDataset, ShardedIterable, shard_indices


@pytest.mark.parametrize("layout", ["strided", "contiguous"])
@pytest.mark.parametrize("num_samples", [0, 1, 3, 10, 12, 13])
@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_shards_are_equal_in_length_and_cover_the_data(num_samples, dp_size, layout):
    dropped = [shard_indices(num_samples, rank, dp_size, uneven="drop", layout=layout) for rank in range(dp_size)]
    assert len({len(shard) for shard in dropped}) == 1
    kept = sorted(itertools.chain(*dropped))
    assert kept == sorted(set(kept)), "drop never repeats a sample"
    assert len(kept) == num_samples - num_samples % dp_size
    if num_samples == 0:
        with pytest.raises(ValueError, match="needs at least one sample"):
            shard_indices(0, 0, dp_size, uneven="pad")
        return
    padded = [shard_indices(num_samples, rank, dp_size, uneven="pad", layout=layout) for rank in range(dp_size)]
    assert len({len(shard) for shard in padded}) == 1
    assert set(itertools.chain(*padded)) == set(range(num_samples)), "pad keeps every sample"
    assert len(list(itertools.chain(*padded))) == -(-num_samples // dp_size) * dp_size


def test_layouts_deal_strided_or_in_blocks():
    assert [shard_indices(8, rank, 2, layout="strided") for rank in range(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [shard_indices(8, rank, 2, layout="contiguous") for rank in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [shard_indices(5, rank, 2, uneven="pad") for rank in range(2)] == [[0, 2, 4], [1, 3, 0]]


def test_sharded_dataset_is_a_map_view():
    shards = [ShardedDataset(list("abcdefg"), rank, 3, uneven="drop") for rank in range(3)]
    assert [[shard[i] for i in range(len(shard))] for shard in shards] == [["a", "d"], ["b", "e"], ["c", "f"]]


@pytest.mark.parametrize(
    ("uneven", "expected"), [("drop", [[0, 3], [1, 4], [2, 5]]), ("pad", [[0, 3, 6], [1, 4, 7], [2, 5, 6]])]
)
def test_sharded_iterable_keeps_every_rank_in_step(uneven, expected):
    streams = [list(ShardedIterable(iter(range(8)), rank, 3, uneven=uneven)) for rank in range(3)]
    assert streams == expected


def test_bad_arguments_name_the_value_and_the_valid_ones():
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, 2\), got 2"):
        shard_indices(4, 2, 2)
    with pytest.raises(ValueError, match="uneven='wrap' is not a policy; valid: 'drop', 'pad'"):
        shard_indices(4, 0, 2, uneven="wrap")
    with pytest.raises(TypeError, match="has no __len__"):
        ShardedDataset(iter(range(3)), 0, 1)
