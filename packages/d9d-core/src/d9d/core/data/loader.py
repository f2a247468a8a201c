"""Stateful data-parallel loading whose position is the number of global samples consumed.

Each step takes the next `global_batch_size` samples of the epoch's order (`ordering`), and rank `dp_rank` gets
the `dp_rank`-th slice of `global_batch_size // dp_size` of them. The saved position, `(epoch, samples consumed)`,
counts samples of that global order, so it means the same on any number of ranks: resuming with another
`dp_size` continues with exactly the samples not consumed yet. The position advances when a batch is handed to the
caller, not when a worker prepares it, so prefetching never skips samples on resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt
from torch.utils.data import DataLoader, Dataset, default_collate

from d9d.core.data.ordering import SampleOrder
from d9d.core.data.sharding import UnevenPolicy

T = TypeVar("T")


@dataclass(frozen=True)
class LoaderPosition:
    """Where a loader stands: in `epoch`, the first `samples_consumed` samples of its global order are consumed."""

    epoch: int = 0
    samples_consumed: int = 0


def local_batch_size(global_batch_size: int, dp_size: int) -> int:
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be at least 1, got {global_batch_size}")
    if dp_size < 1 or global_batch_size % dp_size != 0:
        raise ValueError(
            f"global_batch_size={global_batch_size} does not divide over dp_size={dp_size} data-parallel ranks; "
            f"choose a multiple of {dp_size}."
        )
    return global_batch_size // dp_size


def epoch_batches(
    order: npt.NDArray[np.int64], start: int, global_batch_size: int, uneven: UnevenPolicy
) -> Iterator[npt.NDArray[np.int64]]:
    """Global batches (sample indices) for the rest of an epoch, from its sample `start`.

    The last, incomplete global batch is dropped or padded with samples from the epoch's start, by `uneven`.
    """
    for begin in range(start, len(order), global_batch_size):
        batch = order[begin : begin + global_batch_size]
        if len(batch) < global_batch_size:
            if uneven == "drop":
                return
            batch = np.resize(order, begin + global_batch_size)[begin:]  # np.resize repeats from the start
        yield batch


class _Positioned:
    """The position of a loader and its checkpoint form; shared by the map-style and the stream loader."""

    global_batch_size: int
    position: LoaderPosition = LoaderPosition()

    def state_dict(self) -> dict[str, int]:
        """The position (same on every rank) and the global batch size it was taken with (for information)."""
        return {
            "epoch": self.position.epoch,
            "samples_consumed": self.position.samples_consumed,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position; the data-parallel size, and even the global batch size, may differ."""
        position = LoaderPosition(epoch=int(state["epoch"]), samples_consumed=int(state["samples_consumed"]))
        if position.epoch < 0 or position.samples_consumed < 0:
            raise ValueError(f"invalid loader position {position}: epoch and samples_consumed must not be negative")
        self.position = position


class DataParallelLoader(_Positioned, Generic[T]):
    """Local batches of a map-style dataset for one data-parallel rank; resumable on any data-parallel size.

    Args:
        dataset: a map-style dataset with `__len__`.
        order: which samples each epoch visits, in which order (`SequentialOrder`, `ShuffledOrder`,
            `LengthBucketedOrder`); identical on every rank.
        global_batch_size: samples per step over all data-parallel ranks; a multiple of `dp_size`.
        uneven: an epoch's last, incomplete global batch is dropped ('drop') or padded with repeated samples
            ('pad'), so that every rank runs the same number of steps.
        epochs: how many epochs one iteration runs (from the current position); `None` runs forever.
        num_workers, pin_memory, prefetch_factor: passed to `torch.utils.data.DataLoader`.
    """

    def __init__(
        self,
        dataset: Dataset[T],
        *,
        order: SampleOrder,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        collate_fn: Callable[[list[T]], Any] = default_collate,
        uneven: UnevenPolicy = "drop",
        epochs: int | None = 1,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(f"{type(dataset).__name__} has no __len__; use DataParallelStreamLoader for streams")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        self.local_batch_size = local_batch_size(global_batch_size, dp_size)
        self.dataset = dataset
        self.order = order
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.collate_fn = collate_fn
        self.uneven: UnevenPolicy = uneven
        self.epochs = epochs
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor

    def __iter__(self) -> Iterator[Any]:
        start_epoch = self.position.epoch
        while self.epochs is None or self.position.epoch < start_epoch + self.epochs:
            epoch, consumed = self.position.epoch, self.position.samples_consumed
            order = self.order.epoch_order(epoch)
            if consumed > len(order):
                raise ValueError(f"position {self.position} lies beyond epoch {epoch}'s {len(order)} samples")
            if self.uneven == "drop" and len(order) < self.global_batch_size:
                raise ValueError(
                    f"epoch {epoch} has {len(order)} samples, fewer than one global batch of "
                    f"{self.global_batch_size}; with uneven='drop' it would yield nothing"
                )
            local = _LocalBatches(self, order, consumed)
            loader = DataLoader(
                self.dataset,
                batch_sampler=local,
                collate_fn=self.collate_fn,
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                prefetch_factor=self.prefetch_factor,
            )
            for batch in loader:
                consumed = min(consumed + self.global_batch_size, len(order))
                self.position = LoaderPosition(epoch=epoch, samples_consumed=consumed)
                yield batch
            self.position = LoaderPosition(epoch=epoch + 1, samples_consumed=0)


class _LocalBatches:
    """The batch sampler of one epoch: this rank's slice of each remaining global batch, produced lazily."""

    def __init__(self, loader: DataParallelLoader[Any], order: npt.NDArray[np.int64], start: int) -> None:
        self.loader = loader
        self.order = order
        self.start = start

    def __iter__(self) -> Iterator[list[int]]:
        first = self.loader.dp_rank * self.loader.local_batch_size
        for batch in epoch_batches(self.order, self.start, self.loader.global_batch_size, self.loader.uneven):
            yield [int(index) for index in batch[first : first + self.loader.local_batch_size]]


class DataParallelStreamLoader(_Positioned, Generic[T]):
    """Local batches of a stream for one data-parallel rank, with the same position semantics as the map loader.

    `open_stream(epoch)` must return the same items in the same order on every rank and every call (a
    deterministic reader). Every rank reads the whole stream and keeps its slice of each global batch; resuming
    re-reads and skips the consumed samples, which costs reading them, never a wrong sample.
    """

    def __init__(
        self,
        open_stream: Callable[[int], Iterable[T]],
        *,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        collate_fn: Callable[[list[T]], Any] = default_collate,
        uneven: UnevenPolicy = "drop",
        epochs: int | None = 1,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        self.local_batch_size = local_batch_size(global_batch_size, dp_size)
        self.open_stream = open_stream
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.collate_fn = collate_fn
        self.uneven: UnevenPolicy = uneven
        self.epochs = epochs

    def __iter__(self) -> Iterator[Any]:
        start_epoch = self.position.epoch
        while self.epochs is None or self.position.epoch < start_epoch + self.epochs:
            epoch, consumed = self.position.epoch, self.position.samples_consumed
            stream = iter(self.open_stream(epoch))
            for skipped in range(consumed):
                if next(stream, _END) is _END:
                    raise ValueError(f"position {self.position} lies beyond epoch {epoch}'s {skipped} samples")
            while True:
                batch = [item for _, item in zip(range(self.global_batch_size), stream, strict=False)]
                if not batch or (len(batch) < self.global_batch_size and self.uneven == "drop"):
                    break
                real = len(batch)
                batch = [batch[index % real] for index in range(self.global_batch_size)]
                start = self.dp_rank * self.local_batch_size
                consumed += real
                self.position = LoaderPosition(epoch=epoch, samples_consumed=consumed)
                yield self.collate_fn(batch[start : start + self.local_batch_size])
                if real < self.global_batch_size:
                    break
            self.position = LoaderPosition(epoch=epoch + 1, samples_consumed=0)


_END = object()
