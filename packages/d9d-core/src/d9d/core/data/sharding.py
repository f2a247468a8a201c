"""Data-parallel sharding of map-style and iterable datasets that never leaves ranks with different lengths.

A rank that runs one step more than the others blocks forever in that step's collectives, so every rank must see
the same number of samples. `uneven` chooses how a remainder that does not divide over the ranks is handled:
'drop' leaves it out, 'pad' completes it by repeating samples from the start (each padded position is a real
sample seen twice in the epoch, as with PyTorch's DistributedSampler).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Generic, Literal, TypeVar

from torch.utils.data import Dataset, IterableDataset

T_co = TypeVar("T_co", covariant=True)

UnevenPolicy = Literal["drop", "pad"]
ShardLayout = Literal["strided", "contiguous"]


def _check(dp_rank: int, dp_size: int) -> None:
    if dp_size < 1:
        raise ValueError(f"dp_size must be at least 1, got {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")


def shard_indices(
    num_samples: int, dp_rank: int, dp_size: int, *, uneven: UnevenPolicy = "pad", layout: ShardLayout = "strided"
) -> list[int]:
    """Indices of `range(num_samples)` that rank `dp_rank` of `dp_size` takes; equally many on every rank.

    'strided' gives rank r the samples r, r + dp_size, ...; 'contiguous' gives it one block. With 'pad' and fewer
    samples than ranks, samples repeat as often as needed; with 'drop' every rank may get none.
    """
    _check(dp_rank, dp_size)
    if num_samples < 0:
        raise ValueError(f"num_samples must not be negative, got {num_samples}")
    match uneven:
        case "drop":
            total = num_samples - num_samples % dp_size
        case "pad":
            if num_samples == 0:
                raise ValueError("uneven='pad' needs at least one sample to repeat; the dataset is empty")
            total = -(-num_samples // dp_size) * dp_size
        case _:
            raise ValueError(f"uneven={uneven!r} is not a policy; valid: 'drop', 'pad'")
    per_rank = total // dp_size
    match layout:
        case "strided":
            positions = range(dp_rank, total, dp_size)
        case "contiguous":
            positions = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        case _:
            raise ValueError(f"layout={layout!r} is not a layout; valid: 'strided', 'contiguous'")
    return [position % num_samples for position in positions]


class ShardedDataset(Dataset[T_co], Generic[T_co]):
    """A map-style view of this rank's share of `dataset` (see `shard_indices`)."""

    def __init__(
        self,
        dataset: Dataset[T_co],
        dp_rank: int,
        dp_size: int,
        *,
        uneven: UnevenPolicy = "pad",
        layout: ShardLayout = "strided",
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(f"{type(dataset).__name__} has no __len__; shard an iterable with ShardedIterable")
        self.dataset = dataset
        self.indices = shard_indices(len(dataset), dp_rank, dp_size, uneven=uneven, layout=layout)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> T_co:
        return self.dataset[self.indices[index]]


class ShardedIterable(IterableDataset[T_co], Generic[T_co]):
    """This rank's share of a stream: items are dealt round-robin in groups of `dp_size`.

    Every rank reads the whole stream (keeping one group in memory), so ranks agree on where it ends without
    communicating. A last incomplete group is dropped ('drop') or completed with its own first items ('pad').
    The source must yield the same items in the same order on every rank.
    """

    def __init__(self, source: Iterable[T_co], dp_rank: int, dp_size: int, *, uneven: UnevenPolicy = "pad") -> None:
        _check(dp_rank, dp_size)
        if uneven not in ("drop", "pad"):
            raise ValueError(f"uneven={uneven!r} is not a policy; valid: 'drop', 'pad'")
        self.source = source
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.uneven: UnevenPolicy = uneven

    def __iter__(self) -> Iterator[T_co]:
        group: list[T_co] = []
        for item in self.source:
            group.append(item)
            if len(group) == self.dp_size:
                yield group[self.dp_rank]
                group = []
        if group and self.uneven == "pad":
            yield group[self.dp_rank % len(group)]
