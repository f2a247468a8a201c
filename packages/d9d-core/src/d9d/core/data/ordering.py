"""The order in which an epoch visits a map-style dataset, as a pure function of (seed, epoch).

An order never depends on the data-parallel size: the loader deals consecutive global batches of it out to the
ranks, and its position is a count of samples of this order. That is what lets a run resume on another number of
data-parallel ranks with exactly the samples it had not consumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from d9d.core.data.bucketing import length_bucketed_order

IndexArray = npt.NDArray[np.int64]


class SampleOrder(Protocol):
    """Which samples an epoch visits, in which order (usually a permutation of all of them)."""

    def epoch_order(self, epoch: int) -> IndexArray: ...


@dataclass(frozen=True)
class SequentialOrder:
    num_samples: int

    def epoch_order(self, epoch: int) -> IndexArray:
        del epoch
        return np.arange(self.num_samples, dtype=np.int64)


@dataclass(frozen=True)
class ShuffledOrder:
    """A fresh permutation per epoch, seeded by (seed, epoch)."""

    num_samples: int
    seed: int

    def epoch_order(self, epoch: int) -> IndexArray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples).astype(np.int64)


@dataclass(frozen=True)
class LengthBucketedOrder:
    """Shuffled, then grouped so that each global batch holds samples of similar length (see `bucketing`)."""

    lengths: IndexArray
    global_batch_size: int
    seed: int
    window_batches: int = 64

    def epoch_order(self, epoch: int) -> IndexArray:
        return length_bucketed_order(
            self.lengths,
            self.global_batch_size,
            rng=np.random.default_rng([self.seed, epoch]),
            window_batches=self.window_batches,
        )
