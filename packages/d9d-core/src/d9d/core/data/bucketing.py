"""Length bucketing: batches of samples of similar length, so padding (or packing waste) stays small.

Samples are shuffled, cut into windows of `window_batches` batches, sorted by length inside each window and cut
into batches; the batches are then shuffled, so a step's length is random while a batch's lengths are alike. A
larger window buckets more tightly and randomises less. Ties are broken by the shuffle, never by sample index.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import numpy as np
import numpy.typing as npt

T = TypeVar("T")


def length_bucketed_order(
    lengths: npt.NDArray[np.int64] | list[int],
    batch_size: int,
    *,
    rng: np.random.Generator,
    window_batches: int = 64,
) -> npt.NDArray[np.int64]:
    """An order of `range(len(lengths))` whose consecutive groups of `batch_size` have similar lengths.

    Full batches come first, in random order; the samples that do not fill a batch come last, so a loader that
    drops or pads the remainder of an epoch touches only them.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if window_batches < 1:
        raise ValueError(f"window_batches must be at least 1, got {window_batches}")
    sizes = np.asarray(lengths, dtype=np.int64)
    shuffled = rng.permutation(len(sizes))
    window = batch_size * window_batches
    batches: list[npt.NDArray[np.int64]] = []
    remainder: list[npt.NDArray[np.int64]] = []
    for start in range(0, len(shuffled), window):
        chunk = shuffled[start : start + window]
        chunk = chunk[np.argsort(sizes[chunk], kind="stable")]
        full = len(chunk) - len(chunk) % batch_size
        batches.extend(chunk[offset : offset + batch_size] for offset in range(0, full, batch_size))
        remainder.append(chunk[full:])
    order = [batches[index] for index in rng.permutation(len(batches))] + remainder
    return np.concatenate(order).astype(np.int64) if order else np.zeros(0, dtype=np.int64)


def bucket_stream(
    items: Iterable[T],
    length: Callable[[T], int],
    batch_size: int,
    *,
    rng: np.random.Generator,
    window_batches: int = 64,
) -> Iterator[list[T]]:
    """The streaming form: buffer `window_batches` batches of items, sort them by `length`, yield shuffled batches.

    The last, incomplete batch of the stream is yielded too (the caller's loader decides to drop or pad it).
    """
    if batch_size < 1 or window_batches < 1:
        raise ValueError(f"batch_size and window_batches must be at least 1, got {batch_size} and {window_batches}")
    buffer: list[T] = []
    window = batch_size * window_batches

    def flush(final: bool) -> Iterator[list[T]]:
        shuffled = [buffer[index] for index in rng.permutation(len(buffer))]
        shuffled.sort(key=length)
        full = len(shuffled) - len(shuffled) % batch_size
        batches = [shuffled[offset : offset + batch_size] for offset in range(0, full, batch_size)]
        for index in rng.permutation(len(batches)):
            yield batches[index]
        leftover = shuffled[full:]
        buffer.clear()
        if final:
            if leftover:
                yield leftover
        else:
            buffer.extend(leftover)

    for item in items:
        buffer.append(item)
        if len(buffer) >= window:
            yield from flush(final=False)
    yield from flush(final=True)
